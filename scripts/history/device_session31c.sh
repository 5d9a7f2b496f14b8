#!/usr/bin/env bash
# Session 31 call 3: the one-sided forward mask and the moved tSrS_first clear (71d5ce7) built clean on
# the device (every head dim and dtype), SASS / HGMMA check, every GPU test file, the full benchmark grid, then the
# dense grid in fp16 (issue 6's fp16-within-3 % criterion), all in one call to save a cold start.
set -u
export PYTHONUNBUFFERED=1
CHECK_TIMEOUT=${CHECK_TIMEOUT:-470} bash scripts/history/device_run4.sh
timeout ${FP16_TIMEOUT:-90} python3 -m flash_attn_hopper.benchmark --dtype fp16 --features dense --seqlens 1024,4096,16384 \
  --backends ours,cudnn --no-bar --json $OUT/grid_fp16.json --summary $OUT/grid_fp16_summary.md > $OUT/grid_fp16.log 2>&1
echo "fp16 rc $?"; grep "^| " $OUT/grid_fp16.log | head -n 40
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_after.txt
