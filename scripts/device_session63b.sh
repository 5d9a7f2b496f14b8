#!/usr/bin/env bash
# Session 63, call 4: USED (the forward's O normalised by the sum of the rounded P it multiplies V with; a build of
# head_dim 64 and 128 made on the CPU machine from benchmarks/results/2026-12-06_session63/fwd_used_sum_LOST.patch) against
# DQEF (the head's kernels, full build). First the GPU test files on USED (the other head dims skip: not in its
# build), then forward TFLOP/s, bf16, two rounds in the order DQEF, USED, USED, DQEF.
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/used.tar.xz", ".whl"]
OUT=${OUT:-/tmp/s63b}
PREBUILT=USED PACK=used PHASES=parallel BUDGET=${TEST_S:-260} OUT=$OUT/tests bash scripts/device_check_parallel.sh \
  > "$OUT/tests_used.log" 2>&1
echo "tests rc $?"; grep -m 40 "^tests:\|FAILED\|no result" "$OUT/tests/summary.txt"
TAG=s63b source "$(dirname "$0")/device_packs.sh" dqef used
points() {
  use_pack $1; echo "== round $2: $1"
  timeout 60 python3 scripts/fwd_points.py 64,128 1024,4096,16384 | grep -v "head_dim\|---"
  timeout 30 python3 scripts/fwd_points.py 128 4096,16384 --causal no --softcap 30 | grep -v "head_dim\|---"
}
points DQEF 1; points USED 1; points USED 2; points DQEF 2
