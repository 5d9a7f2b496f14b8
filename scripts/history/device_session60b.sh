#!/usr/bin/env bash
# Session 60's second call, on DQEF (a full build of the head's C++, cf14058; main's later C++ changes are comments):
# on an H200 (none since session 45) the grid first, then round 27's GPU file (mended in 28b769b, not rerun since)
# and the deterministic file (three of its tests failed on DQP2's pairs: they must pass on the head); on any other
# card the full GPU check of the tree instead (every file, on the head's kernels).
#   carry [".whl", ".prebuilt/pack/dqef.tar.xz"]
set -u
OUT=${OUT:-/tmp/s60b}; mkdir -p "$OUT"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  TAG=s60b source "$(dirname "$0")/device_packs.sh" dqef
  use_pack DQEF
  timeout ${GRID_S:-200} python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 \
    --direction both --no-bar --json "$OUT/grid_S60.json" --summary "$OUT/grid_S60_summary.md" > "$OUT/grid.log" 2>&1
  echo "grid rc $?"; cat "$OUT/grid_S60_summary.md"
  timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_bug_reports_twentyseventh_gpu.py \
    tests/test_deterministic_gpu.py > "$OUT/tests_DQEF.log" 2>&1
  echo "tests rc $?: $(tail -n 1 "$OUT/tests_DQEF.log")"
  grep -m 15 "^FAILED\|^ERROR" "$OUT/tests_DQEF.log"
else
  PREBUILT=DQEF PACK=dqef BUDGET=${BUDGET:-540} OUT=$OUT bash "$(dirname "$0")/device_check_parallel.sh"
  echo "check rc $?"; cat "$OUT/summary.txt"
fi
