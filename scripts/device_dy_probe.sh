#!/usr/bin/env bash
# The deterministic head_dim 256 causal backward's turn wait, split further (DX pack, dx_probe.patch, FAH_BWD_DEBUG):
# 16 spins with relaxed loads and then one acq_rel fence (not an acquire load per spin), 32 drops the proxy fence
# after the wait (a wrong order for the TMA reductions: timing only), 48 both. Session 57 so far (H100): no turn wait
# +15 %, no completion wait 0 %, the turn awaited before the chunks are ready -1 to -2 %.
#   carry [".prebuilt/pack/dx.tar.xz"]; OUT=$OUT bash scripts/device_dy_probe.sh
TAG=dy source "$(dirname "$0")/device_packs.sh" dx
use_pack DX
for r in 1 2; do
  order=(0 16 32 48 1); (( r == 2 )) && order=(1 48 32 16 0)
  for f in "${order[@]}"; do
    echo "== round $r: FAH_BWD_DEBUG=$f"
    FAH_BWD_DEBUG=$f GQA_DETERMINISTIC=1 GQA_CAUSAL=yes timeout 40 python3 scripts/gqa_bwd_points.py 4096,16384 16 256 \
      | grep -v "^#"
  done
done 2>&1 | tee "$OUT/dy_probe.txt"
