#!/usr/bin/env bash
# Session 58's second device call: DQE landed (cf14058, the head_dim 256 backward's consumers await the writer's
# DQEmpty with dV and dK issued). The DQEF pack is that head built in full (NAME=DQEF bash scripts/build_pack.sh).
# 1. head_dim 256 backward points, S56 (the C++ before DQE) and DQEF beside, 2 rounds in alternating order: dense
#    16/16 causal and not, 1024 / 4096 / 16384, default and deterministic (predicted: causal +3-5 %, deterministic
#    +2-4 %, non-causal level to +3 %: dK and dV no longer wait behind the DQEmpty sync in any mode).
# 2. the grid on DQEF beside cuDNN and FA2 (the same call; compare grid_S56 of session 57, same card kind).
#   carry [".prebuilt/pack/s56.tar.xz", ".prebuilt/pack/dqef.tar.xz"]; OUT=$OUT bash scripts/history/device_session58b.sh
# Then the GPU check: PREBUILT=DQEF PACK=dqef BUDGET=540 OUT=$OUT bash scripts/device_check_parallel.sh
TAG=s58b source "$(dirname "$0")/device_packs.sh" s56 dqef
points() {
  use_pack $1
  echo "== round $2: $1"
  for c in yes no; do
    GQA_CAUSAL=$c timeout 40 python3 scripts/gqa_bwd_points.py 1024,4096,16384 16 256 | grep -v "^#" \
      | sed 's/$/ default/'
    GQA_DETERMINISTIC=1 GQA_CAUSAL=$c timeout 40 python3 scripts/gqa_bwd_points.py 1024,4096,16384 16 256 \
      | grep -v "^#" | sed 's/$/ deterministic/'
  done
}
for r in "S56 DQEF 1" "DQEF S56 2"; do set -- $r; points $1 $3; points $2 $3; done 2>&1 | tee "$OUT/dqe_points.txt"
use_pack DQEF
timeout ${GRID_S:-160} python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 --direction both --no-bar \
  --json "$OUT/grid_S58.json" --summary "$OUT/grid_S58_summary.md" > "$OUT/grid.log" 2>&1
echo "grid rc $?"; cat "$OUT/grid_S58_summary.md"
