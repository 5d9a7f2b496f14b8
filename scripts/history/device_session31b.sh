#!/usr/bin/env bash
# Prepared in session 30 for the next one (not run yet): the forward mask with one compare per element where no row
# of a thread has a left limit in the block (Window::apply<kOneSided>, two-consumer kernels only; the causal diagonal
# and seqlen_k's cut: 64 ISETP + 64 FSEL per masked head_dim 64/128 block instead of 128 ISETP + 64 FSEL + 34 VIADD;
# benchmarks/results/2026-12-03_h200_session30/fwd_mask_one_sided_UNTESTED.patch). Builds made on the CPU machine and
# carried in .prebuilt/pack/p.tar.xz: CT = the submitted kernels (session 29's full build; SASS equal to 3182d08's),
# MK = the patch (head_dim 64 and 128, bf16). Forward-side GPU test files on MK first, then three rounds of the
# forward at head_dim 64/128 with the window and softcap points, CT / MK alternating.
set -u
export PYTHONUNBUFFERED=1
bash scripts/device_fwd_tests.sh MK
CASES="CT;MK" DIRECTION=fwd ROUNDS=${ROUNDS:-3} TAG=mk BACKENDS=ours \
  BENCH="--head-dims 64,128 --causal both --features dense,window,softcap --seqlens 512,1024,2048,4096,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-330} bash scripts/device_env_ab.sh
