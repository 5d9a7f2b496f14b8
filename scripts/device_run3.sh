#!/usr/bin/env bash
# One device call: the GPU check from a clean build (SASS, tests, benchmark) and train_lm; results within 8 files.
set -u
FINAL=$OUT
export OUT=/tmp/gc
mkdir -p $OUT
rm -f flash_attn_hopper/_C*.so; rm -rf build .fah_build
bash scripts/gpu_check.sh > /tmp/gpu_check.out 2>&1
tail -n 75 /tmp/gpu_check.out | grep -v "^| dense | \(64\|256\)"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout ${TRAIN_TIMEOUT:-150} python3 examples/train_lm.py ${TRAIN_ARGS:-} --json $OUT/train_lm.json > $OUT/train_lm.log 2>&1
tail -n 8 $OUT/train_lm.log
for f in summary.txt pytest.log kernels.txt bench_attention.json bench_extra.tar.gz; do cp -f $OUT/$f $FINAL/ 2>/dev/null; done
tar -czf $FINAL/misc.tar.gz -C $OUT junit.xml train_lm.json train_lm.log build.log 2>/dev/null
ls $FINAL
