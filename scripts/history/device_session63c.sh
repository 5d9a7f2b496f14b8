#!/usr/bin/env bash
# Session 63, call 5 (device budget short, so tests and timing in one call):
# USEDF (a full build of benchmarks/results/2026-12-06_session63/fwd_used_sum_LOST.patch: the forward's O normalised by
# the sum of the rounded P it multiplies V with) against DQEF (the head's kernels, full build). First the forward's
# GPU test files and the thirty-first round on USEDF, then forward TFLOP/s, bf16, two rounds in the order DQEF,
# USEDF, USEDF, DQEF.
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/usedf.tar.xz", ".whl"]
TAG=s63c source "$(dirname "$0")/device_packs.sh" dqef usedf
use_pack USEDF
pytest_log tests_usedf tests ${T_S:-170} 8 tests/test_bug_reports_thirtyfirst_gpu.py tests/test_fwd_gpu.py \
  tests/test_fwd_boundary_gpu.py tests/test_softcap_accuracy_gpu.py tests/test_features_gpu.py \
  tests/test_varlen_gpu.py tests/test_documents_gpu.py tests/test_bug_reports_sixteenth_gpu.py \
  tests/test_random_configs_gpu.py tests/test_bug_reports_thirtieth_gpu.py
points() {
  use_pack $1; echo "== round $2: $1"
  timeout 60 python3 scripts/fwd_points.py 64,128,256 4096,16384 | grep -v "head_dim\|---"
  timeout 30 python3 scripts/fwd_points.py 128 4096,16384 --causal no --softcap 30 | grep -v "head_dim\|---"
}
points DQEF 1; points USEDF 1; points USEDF 2; points DQEF 2
