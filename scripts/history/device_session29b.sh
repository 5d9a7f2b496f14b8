#!/usr/bin/env bash
# Session 29 call 2, on the machine of call 1 (the carried .so is already in place; if the machine was given back,
# it is unpacked again): the full grid (scripts/gpu_check.sh's bench stage: ours, cuDNN, FA2, the feature points with
# their dense references timed beside them) with its summary and plots; then Nsight Compute of the head_dim 64
# causal forward at 1024 (issue 6's 0.97x cuDNN point) and 16384, for the instruction-fetch stalls (No Instruction)
# that session 28's lesson points at.
# (The gpu_check block is scripts/device_prebuilt_check.sh since session 29's review: the same commands.)
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
FAH_SKIP_TESTS=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-300} bash scripts/device_prebuilt_check.sh FIN29
CASES="64 1024 dense causal;64 16384 dense causal" TAG=hd64causal NCU_TIMEOUT=100 timeout 240 bash scripts/ncu_fwd.sh
