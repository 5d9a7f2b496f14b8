#!/usr/bin/env bash
# One device call: a development build (FAH_HDIMS, bf16) from a clean tree, then Nsight Compute on the backward's main
# kernel for each case in $CASES (scripts/ncu_fwd.sh with KERNEL=flash_bwd_sm90_kernel), and the backward breakdown.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source scripts/device_dev_build.sh
KERNEL=flash_bwd_sm90_kernel TAG=${TAG:-bwd} CASES=${CASES:-"256 16384 dense bwd;256 4096 dense causal bwd"} \
  bash scripts/ncu_fwd.sh
[ -z "${BREAKDOWN:-}" ] || python3 scripts/bwd_breakdown.py $BREAKDOWN 2>&1 | tee $OUT/bwd_breakdown.log
