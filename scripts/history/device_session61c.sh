#!/usr/bin/env bash
# Prepared in session 61, not run (no machine came). On DQEF (a full build of the head's C++; no C++ change since
# cf14058): the benchmark grid (ours, cuDNN and FA2 in the same run, from 1024 to 16384, forward and backward, with
# the feature points) on whichever card comes, after round 29's GPU file as mended after its review.
#   carry [".prebuilt/pack/dqef.tar.xz"]; SEQLENS, FEATURES and GRID_S narrow the grid to the device time left.
TAG=s61c source "$(dirname "$0")/device_packs.sh" dqef
use_pack DQEF
round29_check
timeout ${GRID_S:-230} python3 -m flash_attn_hopper.benchmark --seqlens ${SEQLENS:-1024,4096,16384} \
  --direction both --features ${FEATURES:-dense,gqa,varlen,window,softcap,deterministic} --no-bar \
  --json "$OUT/grid_S61.json" --summary "$OUT/grid_S61_summary.md" > "$OUT/grid.log" 2>&1
echo "grid rc $?"; cat "$OUT/grid_S61_summary.md"
