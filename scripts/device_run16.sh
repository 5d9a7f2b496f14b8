#!/usr/bin/env bash
# Issue 4 (development, ~4 min): a head_dim 64 bf16 build (train_lm's kernels), then examples/train_lm.py twice with
# --repeats, as is and without transformers' per-forward packed-sequence host synchronisation (scripts/sync_cost.py).
set -u
export PYTHONPATH=$PWD
OUT_FINAL=$OUT
source scripts/device_dev_build.sh
for mode in "" --no-packed-check; do
  tag=${mode:-default}; tag=${tag#--}
  timeout 200 python3 scripts/sync_cost.py $mode --repeats ${REPEATS:-3} --steps ${STEPS:-200} --log-every 100 \
    --json $OUT_FINAL/train_$tag.json > $OUT_FINAL/train_$tag.log 2>&1
  echo "== $tag rc $?"; tail -n 7 $OUT_FINAL/train_$tag.log
done
