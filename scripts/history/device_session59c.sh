#!/usr/bin/env bash
# Session 59 call 2 (ran): key-block pairs, DQPF = the full build of their first form, with cluster-scope barrier
# operations (the CTA-scope form is benchmarks/results/2026-12-06_session59/dq_pair_UNRUN_CTA_SCOPE.patch).
# 1. A/B, head_dim 256 bwd 16/16: DQEF (the head), DQPF, DQPF with FAH_BWD_DQ_PAIR=0; two rounds, alternating order.
#    Predicted: default +3-6 %, deterministic causal +8-15 % (session 59 call 1: no dQ out at all +8-12 % / +27-34 %).
# 2. The GPU tests that run the head_dim 256 backward, on DQPF (tests/test_dq_pair_gpu.py runs each case with and
#    without the pairs), for what the time limit leaves.
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/dqpf.tar.xz"]
TAG=s59c source "$(dirname "$0")/device_packs.sh" dqef dqpf
{ bwd256_points DQEF 1; bwd256_points DQPF 1; FAH_BWD_DQ_PAIR=0 bwd256_points DQPF 1; bwd256_points DQPF 2
  bwd256_points DQEF 2; } 2>&1 \
  | tee "$OUT/dqp_ab.txt"
use_pack DQPF
timeout ${TEST_S:-260} python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_dq_pair_gpu.py \
  tests/test_deterministic_gpu.py tests/test_bug_reports_twentyseventh_gpu.py tests/test_sections_gpu.py \
  tests/test_bwd_gpu.py tests/test_varlen_gpu.py tests/test_documents_gpu.py > "$OUT/tests_DQPF.log" 2>&1
echo "tests rc $?: $(tail -n 1 "$OUT/tests_DQPF.log")"
grep -m 15 "^FAILED\|^ERROR" "$OUT/tests_DQPF.log"
