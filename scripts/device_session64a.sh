#!/usr/bin/env bash
# Session 64, call 1: RSTC (O normalised by the row sums of the rounded P taken on the tensor cores: P times a block of
# ones, issued with P V; a full build of this tree's csrc made on the CPU machine) against DQEF (session 63's head
# kernels, full build). Round 31 on RSTC (its marks removed in the tree: all 42 must pass),
# then forward TFLOP/s in the order DQEF, RSTC, RSTC, DQEF: bf16 at head_dim 64/128/256, softcap 30 at 128, fp16 at
# 64/128.
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/rstc.tar.xz", ".whl"]
TAG=s64a source "$(dirname "$0")/device_packs.sh" dqef rstc
use_pack RSTC
pytest_log round31_rstc round31 ${T_S:-90} 8 -rxX tests/test_bug_reports_thirtyfirst_gpu.py
grep -c "XPASS" "$OUT/round31_rstc.log"
points() {
  use_pack $1; echo "== round $2: $1"
  timeout 60 python3 scripts/fwd_points.py 64,128,256 4096,16384 | grep -v "head_dim\|---"
  timeout 30 python3 scripts/fwd_points.py 128 4096,16384 --causal no --softcap 30 | grep -v "head_dim\|---"
  timeout 30 python3 scripts/fwd_points.py 64,128 16384 --dtype fp16 | grep -v "head_dim\|---" | sed 's/$/ fp16/'
}
points DQEF 1; points RSTC 1; points RSTC 2; points DQEF 2
