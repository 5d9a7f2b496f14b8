#!/usr/bin/env bash
# One device call within ~7 minutes: the GPU check from a clean build (SASS, tests with a per-test hang guard,
# benchmark with the feature points), then examples/train_lm.py when TRAIN=1; results within 8 files in $OUT.
# PYTEST_EXTRA: more pytest arguments (e.g. --ignore of a file left for a second call).
# (scripts/history/device_run2.sh adds a build-once smoke test and a persistent vs one-CTA-per-tile forward A/B.)
set -u
FINAL=$OUT
export OUT=/tmp/gc
mkdir -p $OUT
rm -f flash_attn_hopper/_C*.so; rm -rf build .fah_build
PYTEST_ARGS="--timeout 150 --timeout-method thread ${PYTEST_EXTRA:-}" timeout ${CHECK_TIMEOUT:-440} bash scripts/gpu_check.sh > /tmp/gpu_check.out 2>&1
echo "gpu_check rc $?"
tail -n 80 /tmp/gpu_check.out | grep -v "^| dense | \(64\|256\)"
if [[ ${TRAIN:-0} == 1 ]]; then
  PYTHONPATH=$PWD timeout ${TRAIN_TIMEOUT:-150} python3 examples/train_lm.py ${TRAIN_ARGS:-} --json $FINAL/train_lm.json \
    > $OUT/train_lm.log 2>&1
  tail -n 8 $OUT/train_lm.log
fi
for f in summary.txt pytest.log kernels.txt bench_attention.json bench_extra.tar.gz build.log; do cp -f $OUT/$f $FINAL/ 2>/dev/null; done
[ -f $OUT/bench.log ] && cp -f $OUT/bench.log $FINAL/
gzip -f $FINAL/build.log 2>/dev/null
ls $FINAL
