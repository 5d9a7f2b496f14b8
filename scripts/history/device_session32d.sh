#!/usr/bin/env bash
# Prepared in session 31 for the next one (not run yet): the forward's tiles in L2-sized sections of (head, batch)
# pairs, query blocks longest first across a section, for causal-like launches (a right limit, no left one)
# (benchmarks/results/2026-12-03_h200_session31/fwd_sectioned_tile_order_UNTESTED.patch; FAH_FWD_SECTION_MIB, default
# 24, 0 = the head-major order of the submitted kernels). One build made on the CPU machine, carried in
# .prebuilt/pack/p.tar.xz: SC (head_dim 64/128/256 bf16). The forward-side GPU test files on SC first (sections on),
# then three rounds of the masked forward, SC with FAH_FWD_SECTION_MIB=0 / SC alternating.
# Prediction (a list-scheduling model, launch_fwd_sm90.hpp): head_dim 256 causal 1024 and 2048 +5-10 %, head_dim 128
# causal 1024 and 4096 +3-5 %, head_dim 64 causal +1-2 %; a model, not a measurement: session 5's sections of
# 24 MiB (benchmarks/NOTES.md, session 5 item 3) were noise for causal at 16384 (and lost without a mask).
set -u
export PYTHONUNBUFFERED=1
bash scripts/device_fwd_tests.sh SC
CASES="SC FAH_FWD_SECTION_MIB=0;SC" DIRECTION=fwd ROUNDS=${ROUNDS:-3} TAG=sc BACKENDS=ours \
  BENCH="--head-dims 64,128,256 --causal yes --features dense --seqlens 512,1024,2048,4096,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-330} bash scripts/device_env_ab.sh
