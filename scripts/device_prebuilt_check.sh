#!/usr/bin/env bash
# usage: [FAH_SKIP_TESTS=1 | FAH_SKIP_BENCH=1] [CHECK_TIMEOUT=s] bash scripts/device_prebuilt_check.sh BUILD
# scripts/gpu_check.sh on a build made on the CPU machine and carried as .prebuilt/BUILD (its _C.abi3.so and build.log
# with the ptxas report) in one of the .tar.xz files of .prebuilt/pack (all are unpacked): FAH_PREBUILT=1, the
# caller's FAH_SKIP_* knobs passed on. The check's logs stay in /tmp/gc_BUILD; summary.txt, pytest.log, kernels.txt,
# bench_attention.json and bench_extra.tar.gz (those that exist) are copied to $OUT.
set -u
B=$1
if [[ ! -f .prebuilt/$B/_C.abi3.so ]]; then
  shopt -s nullglob
  packs=(.prebuilt/pack/*.tar.xz)
  if (( ${#packs[@]} == 0 )); then echo "no .prebuilt/pack/*.tar.xz carried" >&2; exit 1; fi
  for f in "${packs[@]}"; do
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" "$f" || exit 1
  done
  if [[ ! -f .prebuilt/$B/_C.abi3.so ]]; then echo "no .prebuilt/$B/_C.abi3.so in the packs" >&2; exit 1; fi
fi
rm -f flash_attn_hopper/_C*.so
cp -f .prebuilt/$B/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
FINAL=$OUT
export OUT=/tmp/gc_$B; mkdir -p $OUT
FAH_PREBUILT=1 FAH_BUILD_LOG=$PWD/.prebuilt/$B/build.log PYTEST_ARGS="--timeout 150 --timeout-method thread" \
  timeout ${CHECK_TIMEOUT:-540} bash scripts/gpu_check.sh > /tmp/gpu_check_$B.out 2>&1
echo "gpu_check rc $?"
grep -E "^(tests|sass|bench|cutlass) |passed|failed|FAILED|Error|HGMMA check" /tmp/gpu_check_$B.out | tail -n 25
for f in summary.txt pytest.log kernels.txt bench_attention.json bench_extra.tar.gz; do
  if [[ -f $OUT/$f ]]; then cp -f $OUT/$f $FINAL/; fi
done
