#!/usr/bin/env bash
# Ran in session 61 (call 3, an H100; DQPT lost -16 to -19 % deterministic: benchmarks/NOTES.md "Session 61").
# DQPT: the deterministic head_dim 256 backward's dQ turn per pass (a counter per dQ pass, so the next key block adds
# its first pass while this one waits for its second; session 61's lanes trace put the deterministic loss in each
# hand-off's lag, not in the slack between neighbours). Pack: NAME=DQPT FAH_HDIMS=256 FAH_DTYPES=bf16
# PATCHES=benchmarks/results/2026-12-06_session61/dq_turn_per_pass_LOST.patch bash scripts/build_pack.sh
# (DQEF: the head, full build).
# 1. A/B against DQEF, two rounds in alternating order; 2. DQPT's deterministic and head_dim 256 backward tests;
# 3. on DQEF, the two tests of test_bwd_gqa_group_gpu.py that the GPU check's time limit cut; 4. round 29 on DQEF.
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/dqpt.tar.xz"]
TAG=s61b source "$(dirname "$0")/device_packs.sh" dqef dqpt
{ bwd256_points DQEF 1; bwd256_points DQPT 1; bwd256_points DQPT 2; bwd256_points DQEF 2; } 2>&1 \
  | tee "$OUT/dqpt_ab.txt"
use_pack DQPT
timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_deterministic_gpu.py \
  tests/test_bug_reports_twentysixth_gpu.py tests/test_bug_reports_twentyseventh_gpu.py tests/test_bwd_gpu.py \
  tests/test_documents_gpu.py tests/test_random_configs_gpu.py > "$OUT/tests_DQPT.log" 2>&1
echo "tests rc $?: $(tail -n 1 "$OUT/tests_DQPT.log")"
grep -m 15 "^FAILED\|^ERROR" "$OUT/tests_DQPT.log"
use_pack DQEF
timeout ${GQA_S:-200} python3 -m pytest -q -p no:cacheprovider tests/test_bwd_gqa_group_gpu.py \
  -k "head-per-cta or forced_modes" > "$OUT/gqa_group_rest.log" 2>&1
echo "gqa group rest rc $?: $(tail -n 1 "$OUT/gqa_group_rest.log")"
timeout ${R29_S:-150} python3 -m pytest -q -p no:cacheprovider -n 4 --durations=5 \
  tests/test_bug_reports_twentyninth_gpu.py \
  > "$OUT/round29.log" 2>&1
echo "round 29 rc $?: $(tail -n 1 "$OUT/round29.log")"
grep -m 15 "^FAILED\|^ERROR" "$OUT/round29.log"
