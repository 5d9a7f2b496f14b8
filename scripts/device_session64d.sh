#!/usr/bin/env bash
# Session 64, call 4: the full GPU check of this tree on CLAMPF (a full build of its C++ made on the CPU machine with
# the H200's torch; the fp16 forward epilogue's clamp, round 31's FW cases unmarked).
#   carry [".prebuilt/pack/clampf.tar.xz", ".whl"]
PREBUILT=CLAMPF PACK=clampf BUDGET=${BUDGET:-560} exec bash "$(dirname "$0")/device_check_parallel.sh"
