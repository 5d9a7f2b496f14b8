#!/usr/bin/env bash
# Session 27 call 7 (builds made on the CPU machine, in .prebuilt/pack/p.tar.xz): FINAL = the submitted kernels,
# S0 = head_dim 128 bf16 built with FAH_SPLIT_QK 0 (the fixed-maximum softcap's QKᵀ as one GEMM instead of two N = 64
# halves; session 11 measured the split at +1-3 % on the kernel of that time). (1) The forward test files on S0.
# (2) A/B of FINAL and S0, ROUNDS rounds, softcap 30 at head_dim 128.
set -u
VARIANT=S0 CASES="FINAL;S0" TAG=split_qk ROUNDS=${ROUNDS:-3} AB_TIMEOUT=${AB_TIMEOUT:-200} TEST_TIMEOUT=${TEST_TIMEOUT:-120} \
  BENCH="--head-dims 128 --features softcap --seqlens 1024,4096,16384 --no-check --no-adjacent" \
  bash scripts/device_variant_ab.sh
