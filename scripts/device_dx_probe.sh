#!/usr/bin/env bash
# Where the deterministic head_dim 256 causal backward's time goes (0.82-0.83 of the default on the H100, issue 7 asks
# >= 0.87). The DX pack (benchmarks/results/2026-12-06_session57/dx_probe.patch, FAH_HDIMS=256 bf16) reads
# FAH_BWD_DEBUG at every call: 1 no turn wait, 2 no wait for the dQ reductions to complete before the release, 4 the
# default mode in the deterministic launch order (last key block first, no sections), 8 the deterministic mode in the
# default's order (only with 1: a CTA may otherwise wait on one launched after it). Flags 1 / 2 / 8 give wrong
# orders, so only for timing. Dense 16/16 heads, 16k tokens, 2 rounds.
#   carry [".prebuilt/pack/dx.tar.xz"]; OUT=$OUT bash scripts/device_dx_probe.sh
TAG=dx source "$(dirname "$0")/device_packs.sh" dx
use_pack DX
for r in 1 2; do
  for c in "FAH_BWD_DEBUG=0" "FAH_BWD_DEBUG=4" "GQA_DETERMINISTIC=1 FAH_BWD_DEBUG=0" \
           "GQA_DETERMINISTIC=1 FAH_BWD_DEBUG=1" "GQA_DETERMINISTIC=1 FAH_BWD_DEBUG=3" \
           "GQA_DETERMINISTIC=1 FAH_BWD_DEBUG=9" "GQA_DETERMINISTIC=1 FAH_BWD_DEBUG=11"; do
    echo "== round $r: $c"
    env $c GQA_CAUSAL=yes timeout 40 python3 scripts/gqa_bwd_points.py ${DX_SEQLENS:-4096,16384} 16 256 | grep -v "^#"
  done
done 2>&1 | tee "$OUT/dx_probe.txt"
