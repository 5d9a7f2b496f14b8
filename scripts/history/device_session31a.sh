#!/usr/bin/env bash
# Prepared in session 30 for the next one (not run yet): session 29's review placement of tSrS_first's clear (after
# a tile's first block, where no WGMMA writes it; benchmarks/results/2026-12-03_h200_session30/
# fwd64_cross_clear_after_first_block_UNTESTED.patch) on head_dim 64 builds made on the CPU machine: TW = the
# submitted kernels (session 30's build; its experimental two-CTA kernel stays off without FAH_FWD64_TWIN), CT2H =
# the clear moved (bf16, fp16). Carry .prebuilt/pack (cd .prebuilt && tar cJf pack/p.tar.xz TW CT2H). First the
# forward-side GPU test files on CT2H, then three rounds of the dense forward (the launcher's tiles) and of head_dim 64
# softcap 30 (scripts/fwd_points.py; the benchmark grid has softcap at head_dim 128 only), TW / CT2H alternating.
set -u
export PYTHONUNBUFFERED=1
bash scripts/device_fwd_tests.sh CT2H
CASES="TW;CT2H" DIRECTION=fwd ROUNDS=${ROUNDS:-3} TAG=ct2 BACKENDS=ours \
  BENCH="--head-dims 64 --causal both --features dense --seqlens 512,1024,2048,4096 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-150} bash scripts/device_env_ab.sh
for r in 1 2 3; do
  for b in TW CT2H; do
    cp -f .prebuilt/$b/_C.abi3.so flash_attn_hopper/_C.abi3.so
    echo "== round $r: $b softcap 30"
    PYTHONPATH=$PWD timeout 60 python3 scripts/fwd_points.py 64 1024,4096,16384 --softcap 30 | tail -n 6
  done
done
