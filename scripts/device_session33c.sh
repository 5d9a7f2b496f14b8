#!/usr/bin/env bash
# Prepared in session 32 for the next one (not run yet): the full benchmark grid on H33 (see device_session33b.sh),
# then scripts/fp16_beside.py at four rounds on the points session 32 read below 0.97.
set -u
export PYTHONUNBUFFERED=1
FAH_SKIP_TESTS=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-300} bash scripts/device_prebuilt_check.sh H33
PYTHONPATH=$PWD timeout ${FP16_TIMEOUT:-150} python3 scripts/fp16_beside.py --head-dims 64,128,256 --seqlens 1024,16384 \
  --rounds 4 --json $OUT/fp16_beside.json | tee $OUT/fp16_beside.md
# Wave quantization without a mask (benchmarks/NOTES.md, next steps): head_dim 128 non-causal at 2048 tiles (15.52
# waves of 132 SMs) against 2112 tiles (16 full waves: seqlen 8448 = 66 and 16896 = 132 query blocks of 128 rows),
# batch = 16384 // seqlen. If the idle tail costs what the model says, TFLOP/s at 8448 / 16896 read ~3 % above 8192 /
# 16384; if the power limit gives it back as clock, level.
for r in 1 2; do
  timeout 60 python3 -m flash_attn_hopper.benchmark --head-dims 128 --causal no --features dense \
    --seqlens 8192,8448,16384,16896 --direction both --backends ours,cudnn --no-check --no-bar 2>&1 | grep "^| "
done | tee $OUT/waves.md
