#!/usr/bin/env bash
# Prepared in session 32 for the next one (not run yet): the full benchmark grid on H33 (see device_session33b.sh),
# then scripts/fp16_beside.py at four rounds on the points session 32 read below 0.97.
set -u
export PYTHONUNBUFFERED=1
FAH_SKIP_TESTS=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-300} bash scripts/device_prebuilt_check.sh H33
PYTHONPATH=$PWD timeout ${FP16_TIMEOUT:-150} python3 scripts/fp16_beside.py --head-dims 64,128,256 --seqlens 1024,16384 \
  --rounds 4 --json $OUT/fp16_beside.json | tee $OUT/fp16_beside.md
