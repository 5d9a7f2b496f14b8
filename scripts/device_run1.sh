#!/usr/bin/env bash
# One device call: the GPU check (build, SASS, tests, benchmark), the host-overhead probe and train_lm.
set -u
FINAL=$OUT
export OUT=/tmp/gc
mkdir -p $OUT
bash scripts/gpu_check.sh > /tmp/gpu_check.out 2>&1
tail -n 60 /tmp/gpu_check.out
export PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout 60 python3 scripts/host_overhead.py > $FINAL/host.txt 2>&1; cat $FINAL/host.txt
timeout ${TRAIN_TIMEOUT:-150} python3 examples/train_lm.py ${TRAIN_ARGS:-} --json /tmp/gc/train_lm.json > /tmp/gc/train_lm.log 2>&1
tail -n 12 /tmp/gc/train_lm.log | tee $FINAL/train_lm.txt
for f in summary.txt pytest.log kernels.txt bench_attention.json bench_extra.tar.gz; do cp -f $OUT/$f $FINAL/ 2>/dev/null; done
tar -czf $FINAL/misc.tar.gz -C $OUT build.log junit.xml train_lm.json train_lm.log 2>/dev/null
ls $FINAL
