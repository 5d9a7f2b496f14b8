#!/usr/bin/env bash
# Session 43, one call: (1) the SymInt varlen compile test and the graph count on the tree's full device build
# (.prebuilt/pack/verify_so.tar.xz); (2) softcap forward/backward at head_dim 128 with session 34's polynomial-only
# tanh (PO, timing only: wrong above |x| = 0.5, and the benchmark inputs stay below it) beside S42 (the head's kernels),
# 2 rounds in the order S42 PO PO S42.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for p in verify_so s42 po; do python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" .prebuilt/pack/$p.tar.xz; done
cp .prebuilt/VERIFY/_C.abi3.so flash_attn_hopper/_C.abi3.so
FAH_PREBUILT=1 timeout 150 python3 -m pytest -q tests/test_compile_gpu.py -k varlen 2>&1 | tail -n 3 | tee $OUT/compile_varlen_pytest.txt
TORCH_LOGS=recompiles timeout 120 python3 scripts/varlen_compile_graphs.py 2>&1 | grep -v Warn | tail -n 12 | tee $OUT/varlen_compile_graphs.txt
for b in S42 PO PO S42; do
  cp .prebuilt/$b/_C.abi3.so flash_attn_hopper/_C.abi3.so
  echo "== $b"; timeout 80 python3 scripts/softcap_paths_time.py 128 4096,16384 30 1 2>&1 | tee -a $OUT/softcap_po_$b.txt
done
