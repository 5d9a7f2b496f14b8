#!/usr/bin/env bash
# Session 30 call 4: the submitted kernels (csrc as in call 1's clean build of 3182d08) built clean on the device,
# the full benchmark grid with the feature points (scripts/gpu_check.sh's bench stage; tests ran in call 1 on the
# same csrc), then the dense grid in fp16 (forward and backward, every head dim, 1024/4096/16384, ours and cuDNN) for
# issue 6's fp16-within-3 % criterion.
set -u
export PYTHONUNBUFFERED=1
FAH_SKIP_TESTS=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-330} bash scripts/history/device_run4.sh
timeout ${FP16_TIMEOUT:-150} python3 -m flash_attn_hopper.benchmark --dtype fp16 --features dense --seqlens 1024,4096,16384 \
  --backends ours,cudnn --no-bar --json $OUT/grid_fp16.json --summary $OUT/grid_fp16_summary.md > $OUT/grid_fp16.log 2>&1
echo "fp16 rc $?"; grep "^| " $OUT/grid_fp16.log | head -n 40
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_after.txt
