#!/usr/bin/env bash
# Session 64, call 3: CLAMPF (a full build of this tree's C++ made on the CPU machine: the fp16 forward epilogue clamps
# finite O to fp16's range) against DQEF (session 63's head kernels). Round 31 on CLAMPF (FW unmarked: must pass; FX
# still strict expected failures), then fp16 forward TFLOP/s in the order DQEF, CLAMPF, CLAMPF, DQEF.
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/clampf.tar.xz", ".whl"]
TAG=s64c source "$(dirname "$0")/device_packs.sh" dqef clampf
use_pack CLAMPF
pytest_log round31_clampf round31 ${T_S:-90} 8 -rxX tests/test_bug_reports_thirtyfirst_gpu.py
points() {
  use_pack $1; echo "== round $2: $1"
  timeout 60 python3 scripts/fwd_points.py 64,128,256 4096,16384 --dtype fp16 | grep -v "head_dim\|---" \
    | sed 's/$/ fp16/'
}
points DQEF 1; points CLAMPF 1; points CLAMPF 2; points DQEF 2
