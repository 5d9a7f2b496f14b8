#!/usr/bin/env bash
# Session 64, call 2: HM (O normalised by the row sums of the rounded P taken on the tensor cores through mma.sync, P
# times ones at its conversion; a full build of this tree's csrc made on the CPU machine) against DQEF (session 63's
# head kernels, full build). Round 31 on HM (its marks removed in this tree: all 42 must pass), then forward TFLOP/s
# in the order DQEF, HM, HM, DQEF: bf16 at head_dim 64/128/256, softcap 30 at 128, fp16 at 64/128.
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/hm.tar.xz", ".whl"]
TAG=s64b source "$(dirname "$0")/device_packs.sh" dqef hm
use_pack HM
pytest_log round31_hm round31 ${T_S:-90} 8 -rxX tests/test_bug_reports_thirtyfirst_gpu.py
points() {
  use_pack $1; echo "== round $2: $1"
  timeout 60 python3 scripts/fwd_points.py 64,128,256 4096,16384 | grep -v "head_dim\|---"
  timeout 30 python3 scripts/fwd_points.py 128 4096,16384 --causal no --softcap 30 | grep -v "head_dim\|---"
  timeout 30 python3 scripts/fwd_points.py 64,128 16384 --dtype fp16 | grep -v "head_dim\|---" | sed 's/$/ fp16/'
}
points DQEF 1; points HM 1; points HM 2; points DQEF 2
