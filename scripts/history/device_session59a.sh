#!/usr/bin/env bash
# Session 59's first call: session 58's prepared call (scripts/history/device_session58e.sh: round 27's GPU file on DQEF, then
# the dQ-traffic probes DQST / DQNO), then, only if the card is an H200 (none since session 45), the grid on DQEF.
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/dqst.tar.xz", ".prebuilt/pack/dqno.tar.xz"]
bash "$(dirname "$0")/device_session58e.sh"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  cp -f .prebuilt/DQEF/_C.abi3.so flash_attn_hopper/_C.abi3.so
  PYTHONPATH=$PWD timeout ${GRID_S:-170} python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 \
    --direction both --no-bar --json "$OUT/grid_S59.json" --summary "$OUT/grid_S59_summary.md" > "$OUT/grid.log" 2>&1
  echo "grid rc $?"; cat "$OUT/grid_S59_summary.md"
fi
