#!/usr/bin/env bash
# Session 27 call 3 (builds made on the CPU machine, in .prebuilt/pack/p.tar.xz): FINAL = the submitted kernels
# (session 25's full build), T = head_dim 64/128 bf16 with the ping-pong turn handed to the next consumer warpgroup
# once this warpgroup's S = Q Kᵀ has completed instead of right after its GEMMs are issued (all forward kernels).
# (1) The forward test files on T. (2) A/B FINAL against T, ROUNDS rounds, dense and softcap 30. (3) The benchmark's
# new dense references timed beside each feature point, on FINAL, head_dim 128, both directions.
set -u
VARIANT=T CASES="FINAL;T" TAG=turn ROUNDS=${ROUNDS:-2} \
  BENCH="--head-dims 128,64 --features dense,softcap --seqlens 1024,4096,16384 --no-check --no-adjacent" \
  bash scripts/device_variant_ab.sh
export PYTHONUNBUFFERED=1
cp -f .prebuilt/FINAL/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${ADJ_TIMEOUT:-150} python3 -m flash_attn_hopper.benchmark --head-dims 128 --seqlens 1024,16384 --no-bar \
  --features softcap,window,gqa,varlen,deterministic --backends ours --no-check --direction both \
  --json $OUT/adjacent.json --summary $OUT/adjacent_summary.md 2>&1 | grep -E "^\[|Error|error" | tail -n 30
