#!/usr/bin/env bash
# The GPU check of the tree as sent, from a clean build, tests only (no benchmark), logs streamed into $OUT so that a
# run cut short still returns them. Used when too little device time is left for the benchmark grid.
rm -f flash_attn_hopper/_C*.so; rm -rf build .fah_build
FAH_SKIP_BENCH=1 PYTEST_ARGS="--timeout 150 --timeout-method thread" timeout ${CHECK_TIMEOUT:-280} bash scripts/gpu_check.sh \
  > $OUT/gpu_check.out 2>&1
echo "gpu_check rc $?"
grep -E "^(build|sass|tests) " $OUT/gpu_check.out; tail -n 4 $OUT/gpu_check.out
