#!/usr/bin/env bash
# Prepared in session 31 for the next one (not run yet): the backward's one-sided mask on Sᵀ
# (benchmarks/results/2026-12-03_h200_session31/bwd_mask_one_sided_UNTESTED.patch: Window::apply_transposed<kOneSided>,
# one compare per element where no key of a thread has its upper row limit inside the block, i.e. the causal diagonal;
# head_dim 64's softcap consumers keep the two-sided mask). Builds made on the CPU machine, carried in
# .prebuilt/pack/p.tar.xz: BM = the patch (head_dim 64 and 128, bf16), baseline H31 = the submitted kernels (full
# build). The backward-side GPU test files on BM first (other head dims and fp16 skip), then three rounds of the
# backward at head_dim 64/128, dense, window and softcap, H31 / BM alternating.
# Prediction: masked iterations ~685 -> ~585 instructions at head_dim 128 (ptxas, bf16), ~20 % of iterations at causal
# 1024 and ~6 % at 4096: +1-2 % at causal 512-2048 backward, level without a mask.
set -u
export PYTHONUNBUFFERED=1
bash scripts/device_build_tests.sh bwd BM
CASES="H31;BM" DIRECTION=bwd ROUNDS=${ROUNDS:-3} TAG=bm BACKENDS=ours \
  BENCH="--head-dims 64,128 --causal both --features dense,window,softcap --seqlens 512,1024,2048,4096,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-330} bash scripts/device_env_ab.sh
