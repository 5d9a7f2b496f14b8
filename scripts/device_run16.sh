#!/usr/bin/env bash
# Issue 4 (development, ~4 min): a head_dim 64 bf16 build (train_lm's kernels), then examples/train_lm.py twice with
# --repeats, as is and without transformers' per-forward packed-sequence host synchronisation (scripts/sync_cost.py).
set -u
export PYTHONPATH=$PWD
rm -rf build .fah_build flash_attn_hopper/_C*.so
OUT_FINAL=$OUT
OUT=/tmp/gcout FAH_HDIMS=64 FAH_DTYPES=bf16 FAH_SKIP_TESTS=1 FAH_SKIP_BENCH=1 bash scripts/gpu_check.sh > /tmp/gc.log 2>&1
grep -E "^(build|sass) " /tmp/gc.log
for mode in "" --no-packed-check; do
  tag=${mode:-default}; tag=${tag#--}
  timeout 200 python3 scripts/sync_cost.py $mode --repeats ${REPEATS:-3} --steps ${STEPS:-200} --log-every 100 \
    --json $OUT_FINAL/train_$tag.json > $OUT_FINAL/train_$tag.log 2>&1
  echo "== $tag rc $?"; tail -n 7 $OUT_FINAL/train_$tag.log
done
