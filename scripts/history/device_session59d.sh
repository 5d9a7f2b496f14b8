#!/usr/bin/env bash
# Prepared in session 59, ran in session 60 (call 1; the pairs lost and are closed: benchmarks/NOTES.md "Session 60"):
# key-block pairs with CTA-scope barrier operations (DQP2); call 2's DQPF (cluster scope) ran at half speed.
# tests/test_dq_pair_gpu.py is not on main: it comes with the patch below (copy it in before a rerun).
# Build the pack here (~4 min):
#   NAME=DQP2 PATCHES=benchmarks/results/2026-12-06_session59/dq_pair_UNRUN_CTA_SCOPE.patch FAH_HDIMS=256 \
#   FAH_DTYPES=bf16 bash scripts/build_pack.sh   (and NAME=DQEF bash scripts/build_pack.sh if missing: the head)
# 1. A/B against DQEF (the head), two rounds in alternating order; 2. the pairs' tests and the deterministic tests.
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/dqp2.tar.xz"]
TAG=s59d source "$(dirname "$0")/device_packs.sh" dqef dqp2
{ bwd256_points DQEF 1; bwd256_points DQP2 1; bwd256_points DQP2 2; bwd256_points DQEF 2; } 2>&1 \
  | tee "$OUT/dqp2_ab.txt"
use_pack DQP2
timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_dq_pair_gpu.py \
  tests/test_deterministic_gpu.py tests/test_bug_reports_twentyseventh_gpu.py > "$OUT/tests_DQP2.log" 2>&1
echo "tests rc $?: $(tail -n 1 "$OUT/tests_DQP2.log")"
grep -m 15 "^FAILED\|^ERROR" "$OUT/tests_DQP2.log"
