#!/usr/bin/env bash
# Session 25 call 1, on the tree with head_dim 128's 80-row backward tiles (36a897a; not kept, see benchmarks/NOTES.md
# "Session 25"): the GPU check from a clean build (scripts/history/device_run4.sh; every GPU test file but test_varlen_gpu.py
# and that tree's test_bwd_tiles_gpu.py; the 420 s limit cut the tests at test_fwd_tiles_gpu.py), then the backward A/B
# at head_dim 128 without a mask on that build: 64-row tiles (FAH_BWD_BLOCK_M=64) against the chosen 80, ours and
# cuDNN per process, ROUNDS rounds.
set -u
export PYTHONUNBUFFERED=1
FAH_SKIP_BENCH=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-420} \
  PYTEST_EXTRA="--ignore=tests/test_varlen_gpu.py --ignore=tests/test_bwd_tiles_gpu.py" bash scripts/history/device_run4.sh
so=$(compgen -G "flash_attn_hopper/_C*.so" | head -n 1)
[ -n "$so" ] || exit 1
mkdir -p .prebuilt/TREE && cp -f "$so" .prebuilt/TREE/_C.abi3.so && ls -la .prebuilt/TREE
CASES="TREE FAH_BWD_BLOCK_M=64;TREE" DIRECTION=bwd ROUNDS=${ROUNDS:-2} TAG=bwd80 BACKENDS=ours,cudnn \
  BENCH="--head-dims 128 --features dense --seqlens 1024,4096,16384 --causal no --no-check" \
  timeout ${AB_TIMEOUT:-150} bash scripts/device_env_ab.sh
cp -f .prebuilt/TREE/_C.abi3.so "$so"
