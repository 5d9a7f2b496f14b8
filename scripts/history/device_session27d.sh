#!/usr/bin/env bash
# Session 27 call 4 (builds made on the CPU machine, in .prebuilt/pack/p.tar.xz): FINAL = the submitted kernels
# (session 25's full build), E = head_dim 64/128 bf16 with the ping-pong turn handed to the next consumer warpgroup
# right after this warpgroup's QKᵀ is issued, before its P V, instead of after both (all forward kernels; call 3's T,
# the turn handed over once S had completed, lost 8-10 % on softcap). (1) The forward test files on E. (2) A/B of
# FINAL, E and FINAL without ping-pong, ROUNDS rounds, dense and softcap 30.
set -u
VARIANT=E CASES="FINAL;E;FINAL FAH_FWD_PINGPONG=0" TAG=turn_early ROUNDS=${ROUNDS:-2} AB_TIMEOUT=${AB_TIMEOUT:-330} \
  BENCH="--head-dims 128,64 --features dense,softcap --seqlens 1024,4096,16384 --no-check --no-adjacent" \
  bash scripts/device_variant_ab.sh
