#!/usr/bin/env bash
# Session 64, call 3 (the device budget short after failed starts, so both in one call): fp16 forward TFLOP/s of
# CLAMPF (a full build of this tree's C++ made on the CPU machine with the H200's torch: the fp16 epilogue's clamp)
# against DQEF (session 63's head kernels) in the order DQEF, CLAMPF, CLAMPF, DQEF, then the full GPU check of this
# tree on CLAMPF (round 31's FW cases unmarked: they must pass; FX's still strict expected failures).
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/clampf.tar.xz", ".whl"]
(
  TAG=s64d source "$(dirname "$0")/device_packs.sh" dqef
  points() {
    use_pack $1; echo "== round $2: $1"
    timeout 30 python3 scripts/fwd_points.py 64,128 16384 --dtype fp16 | grep -v "head_dim\|---" | sed 's/$/ fp16/'
  }
  python3 -c "import tarfile; tarfile.open('.prebuilt/pack/clampf.tar.xz').extractall('.prebuilt')"
  points DQEF 1; points CLAMPF 1; points CLAMPF 2; points DQEF 2
) 2>&1 | tee "${OUT:-/tmp}/fp16_ab.txt"
PREBUILT=CLAMPF PACK=clampf BUDGET=${BUDGET:-510} exec bash "$(dirname "$0")/device_check_parallel.sh"
