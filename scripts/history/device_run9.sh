#!/usr/bin/env bash
# Short diagnostic call (~3.5 min): a head_dim 64 / bf16 development build, the head_dim 64 forward A/B of the tile
# heights (FAH_FWD_BLOCK_M=128 vs 192, ours only), then scripts/profile_train.py (wall and GPU time per step for each
# backend, per-kernel difference) and a shorter examples/train_lm.py --repeats 2.
set -u
export PYTHONUNBUFFERED=1
FAH_HDIMS=64 AB="FAH_FWD_BLOCK_M=128;FAH_FWD_BLOCK_M=192" TEST_K="64 and bf16 and causal" TEST_TIMEOUT=60 \
  BENCH_ARGS="--backends ours --no-check" bash scripts/device_ab_fwd.sh 2>&1 | grep -v "^== variant" | tail -n 12
{
  PYTHONPATH=$PWD timeout 70 python3 scripts/profile_train.py --steps 5 2>&1 | grep -v Warning
  PYTHONPATH=$PWD timeout 120 python3 examples/train_lm.py --repeats 2 --steps 150 --json $OUT/train_lm.json 2>&1 \
    | grep -v "^\[.*step " | tail -n 6
} 2>&1 | tee $OUT/issue4.txt
