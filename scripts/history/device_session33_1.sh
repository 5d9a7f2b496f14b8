#!/usr/bin/env bash
# Session 33, call 1: every GPU test on H33 (session 32's head with bwd_sectioned_order_UNTESTED.patch, full build
# made on the CPU machine with the device's torch, carried in .prebuilt/pack/p.tar.xz), sections on by default; then
# the forward gate (FAH_FWD_SECTION_MIN_M_BLOCKS=8 against the default 0) at causal 512-1024, 2 rounds.
set -u
export PYTHONUNBUFFERED=1
FAH_SKIP_BENCH=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-450} bash scripts/device_prebuilt_check.sh H33
CASES="H33 FAH_FWD_SECTION_MIN_M_BLOCKS=8;H33" DIRECTION=fwd ROUNDS=2 TAG=gate BACKENDS=ours \
  BENCH="--head-dims 64,128,256 --causal yes --features dense --seqlens 512,1024 --no-check --no-adjacent" \
  timeout 70 bash scripts/device_env_ab.sh
