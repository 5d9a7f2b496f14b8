#!/usr/bin/env bash
# Session 32: every GPU test on H32 (the head's kernels: session 31's plus the backward's one-sided mask and the
# forward's sectioned tile order, built on the CPU machine, carried in .prebuilt/pack/p.tar.xz), then a sweep of the
# forward's section budget (FAH_FWD_SECTION_MIB 0 = head-major, 12, 24 = the default, 8) on the masked forward, 3 rounds:
# the first A/B (SC) read head_dim 128 causal 2048 at 0.94 of head-major (rounds 473 / 478 / 527 vs 507-513).
set -u
export PYTHONUNBUFFERED=1
FAH_SKIP_BENCH=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-430} bash scripts/device_prebuilt_check.sh H32
CASES="H32 FAH_FWD_SECTION_MIB=0;H32 FAH_FWD_SECTION_MIB=8;H32 FAH_FWD_SECTION_MIB=12;H32" DIRECTION=fwd ROUNDS=${ROUNDS:-3} \
  TAG=mib BACKENDS=ours \
  BENCH="--head-dims 64,128,256 --causal yes --features dense --seqlens 512,1024,2048,4096 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-150} bash scripts/device_env_ab.sh > $OUT/ab_mib.txt 2>&1
echo "sweep rc $?"
