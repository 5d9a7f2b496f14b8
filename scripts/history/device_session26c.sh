#!/usr/bin/env bash
# Session 26 call 3, on the machine that built the tree in call 2 (or, if that machine was given back, on the carried
# build .prebuilt/FINAL of the same kernel code): test_varlen_gpu.py, the full grid (ours, cuDNN, FA2, feature
# points), then Nsight Compute of the head_dim 128 backward at 16384 without a mask for session 24's head (W, 64-row
# tiles) and the 80-row tiles of session 25 (R80; not kept), from .prebuilt/pack/p.tar.xz.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
if ! ls flash_attn_hopper/_C*.so 2>/dev/null; then
  echo "no build from call 2 here: using .prebuilt/FINAL"; cp -f .prebuilt/FINAL/_C.abi3.so flash_attn_hopper/_C.abi3.so
fi
so=$(compgen -G "flash_attn_hopper/_C*.so" | head -n 1)
cp -f "$so" /tmp/tree_C.so
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_varlen_gpu.py 2>&1 | tail -n 4 | tee $OUT/pytest_varlen.log
FAH_PREBUILT=1 FAH_SKIP_TESTS=1 timeout 280 bash scripts/gpu_check.sh > $OUT/grid.out 2>&1
cp .fah_build/gpu_check/{bench_attention.json,bench_extra.tar.gz,summary.txt} $OUT/ 2>/dev/null
tail -n 5 $OUT/grid.out
BUILDS="W R80" CASES="128 16384 dense bwd" KERNEL=flash_bwd_sm90_kernel NCU_TIMEOUT=100 \
  timeout 230 bash scripts/device_ncu_prebuilt.sh
cp -f /tmp/tree_C.so "$so"
