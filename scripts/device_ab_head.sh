#!/usr/bin/env bash
# One device call: development builds (FAH_HDIMS, bf16) of the tree as carried (build A) and of the tree with
# $PATCH applied (build B; a unified diff inside the tree, e.g. made with `git diff > ab.patch`), then
# scripts/device_ab_prebuilt.sh on them (BENCH, ROUNDS, DIRECTION, TESTS, TEST_K on B). The device copy's .git can be
# older than the tree (session 14: a `git stash` there reverted every commit since), so nothing here uses git.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
[ -f "${PATCH:-}" ] || { echo "PATCH=file.patch (inside the tree) is required"; exit 2; }
mkdir -p .prebuilt/A .prebuilt/B
source scripts/device_dev_build.sh
cp -f flash_attn_hopper/_C.abi3.so .prebuilt/A/ || exit 1
patch -p1 --forward < "$PATCH" > /dev/null || { echo "PATCH does not apply"; exit 2; }
source scripts/device_dev_build.sh
cp -f flash_attn_hopper/_C.abi3.so .prebuilt/B/ || exit 1
patch -p1 -R < "$PATCH" > /dev/null
BUILDS="A B" bash scripts/device_ab_prebuilt.sh
