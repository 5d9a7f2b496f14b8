#!/usr/bin/env bash
# Session 63: CLAMP (the fp16 forward epilogue clamps finite O to fp16's range; a head_dim 64 / 128 fp16 build made on
# the CPU machine from benchmarks/results/2026-12-06_session63/fwd_fp16_clamp.patch) against DQEF (the head's kernels).
# The thirty-first round and the forward's files on CLAMP (other head dims and bf16 skip: not in its build), then fp16
# forward TFLOP/s in the order DQEF, CLAMP, CLAMP, DQEF.
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/clamp.tar.xz", ".whl"]
TAG=s63d source "$(dirname "$0")/device_packs.sh" dqef clamp
use_pack CLAMP
pytest_log tests_clamp tests ${T_S:-120} 8 -rxX tests/test_bug_reports_thirtyfirst_gpu.py tests/test_fwd_gpu.py \
  tests/test_fwd_boundary_gpu.py tests/test_bug_reports_sixteenth_gpu.py tests/test_features_gpu.py
grep -c "^XFAIL" "$OUT/tests_clamp.log"
points() {
  use_pack $1; echo "== round $2: $1"
  timeout 40 python3 scripts/fwd_points.py 64,128 1024,16384 --dtype fp16 | grep -v "head_dim\|---"
}
points DQEF 1; points CLAMP 1; points CLAMP 2; points DQEF 2
