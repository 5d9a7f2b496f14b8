#!/usr/bin/env bash
# Session 41, last call: the persistent forward's next-tile sum without int32 overflow (build OVF, head_dim 64/128
# bf16, carried in .prebuilt/pack/ovf.tar.xz): the forward test files on it, then ours dense forward at 16384 beside
# the head's full build (VERIFY), 2 rounds, order reversed.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for n in ovf verify_so; do
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" .prebuilt/pack/$n.tar.xz || exit 1
done
cp -f .prebuilt/OVF/_C.abi3.so flash_attn_hopper/_C.abi3.so
[[ ${SKIP_TESTS:-0} == 1 ]] || timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider --timeout 100 --timeout-method thread \
  ${TESTS:-tests/test_fwd_gpu.py tests/test_fwd_boundary_gpu.py} > $OUT/pytest_ovf.log 2>&1
echo "pytest rc $?"; tail -n 4 $OUT/pytest_ovf.log
for r in 1 2; do
  builds="VERIFY OVF"; [[ $r == 2 ]] && builds="OVF VERIFY"
  for b in $builds; do
    cp -f .prebuilt/$b/_C.abi3.so flash_attn_hopper/_C.abi3.so
    timeout 60 python3 -m flash_attn_hopper.benchmark --head-dims 64,128 --causal both --features dense --seqlens 16384 \
      --backends ours --direction fwd --no-check --no-adjacent --no-bar > $OUT/bench_${b}_r$r.log 2>&1
    grep "^|" $OUT/bench_${b}_r$r.log | grep -v "^|--" | sed "s/^/r$r $b /" | tee -a $OUT/ab_ovf.txt
  done
done
