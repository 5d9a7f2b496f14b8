#!/usr/bin/env bash
# One device call: development builds (FAH_HDIMS, bf16) of HEAD (build A: the working tree's changes stashed) and of
# the working tree (build B), then scripts/device_ab_prebuilt.sh on them (BENCH, ROUNDS, DIRECTION, TESTS, TEST_K on
# B). Needs the tree's .git (the device copy has it).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p .prebuilt/A .prebuilt/B
git stash -q || exit 1
source scripts/device_dev_build.sh
cp -f flash_attn_hopper/_C.abi3.so .prebuilt/A/ || exit 1
git stash pop -q || exit 1
source scripts/device_dev_build.sh
cp -f flash_attn_hopper/_C.abi3.so .prebuilt/B/ || exit 1
BUILDS="A B" bash scripts/device_ab_prebuilt.sh
