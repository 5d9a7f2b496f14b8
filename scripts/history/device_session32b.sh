#!/usr/bin/env bash
# Prepared in session 31 for the next one (not run yet): the full benchmark grid (scripts/gpu_check.sh's bench stage,
# PNGs included) on the same carried build as scripts/history/device_session32a.sh (.prebuilt/H31), a second reading of
# session 31's grid: issue 6's "at 1024 ours >= cuDNN everywhere" held there by 0.2-1 % at head_dim 256 and 64 causal.
set -u
export PYTHONUNBUFFERED=1
FAH_SKIP_TESTS=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-330} bash scripts/device_prebuilt_check.sh H31
# Then issue 6's fp16 criterion with fp16 and bf16 timed beside each other per point (ours and cuDNN).
PYTHONPATH=$PWD timeout ${FP16_TIMEOUT:-200} python3 scripts/fp16_beside.py --json $OUT/fp16_beside.json | tee $OUT/fp16_beside.md
