#!/usr/bin/env bash
# Prepared in session 32 for the next one (not run yet): the backward's sectioned CTA order for causal-like launches
# (benchmarks/results/2026-12-03_h200_session32/bwd_sectioned_order_UNTESTED.patch: Params::section_pairs,
# FAH_BWD_SECTION_MIB default 24, 0 = the grid's order; also the forward's FAH_FWD_SECTION_MIN_M_BLOCKS gate, default 0
# = today's behaviour, and the shared section-size helper flash/common/tile_order.hpp). Build BS (head_dim 64/128/256
# bf16, made on the CPU machine) in .prebuilt/pack/p.tar.xz. The backward-side GPU test files on BS first (sections
# on), then three rounds of the causal backward with FAH_BWD_SECTION_MIB=0 / default, then two of the causal forward
# at 512-1024 with FAH_FWD_SECTION_MIN_M_BLOCKS=8 / default.
# Prediction (scripts/tile_order_model.py --bwd: the grid's order reaches 0.93-0.95 of the ideal makespan at head_dim
# 128/256 causal 1024-8192, 0.97 at head_dim 64; the launcher's sections 0.98-1.00): backward causal +2-5 % at head_dim
# 128/256 1024-8192, +1-2 % at head_dim 64 (the forward's sections reached about half the modelled gain); level
# without a mask and at 16384. Forward gate: head_dim 64/256 causal 512 +2-3 %, head_dim 128 causal 512 -2 %.
set -u
export PYTHONUNBUFFERED=1
bash scripts/device_build_tests.sh bwd BS
CASES="BS FAH_BWD_SECTION_MIB=0;BS" DIRECTION=bwd ROUNDS=${ROUNDS:-3} TAG=bs BACKENDS=ours \
  BENCH="--head-dims 64,128,256 --causal both --features dense --seqlens 1024,2048,4096,8192,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-240} bash scripts/device_env_ab.sh
CASES="BS FAH_FWD_SECTION_MIN_M_BLOCKS=8;BS" DIRECTION=fwd ROUNDS=2 TAG=gate BACKENDS=ours \
  BENCH="--head-dims 64,128,256 --causal yes --features dense --seqlens 512,1024 --no-check --no-adjacent" \
  timeout 60 bash scripts/device_env_ab.sh
