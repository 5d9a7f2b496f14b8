#!/usr/bin/env bash
# Session 66, call C: head_dim 64's 192-row tiles summing a row in one chain, as the 128-row tiles do (pack W1, built
# with FAH_HDIMS=64), against EX (73e371d). On W1: the tile-height case of round 32 and the forward test files with
# 192-row tiles forced; then the forward at head_dim 64, 192 rows forced, bf16, in the order EX, W1, W1, EX (predicted:
# within 1 %, the maximum keeps its four chains). Worst case of the limits: 190 s.
#   carry [".prebuilt/pack/ex.tar.xz", ".prebuilt/pack/w1.tar.xz"]
TAG=s66c source "$(dirname "$0")/device_packs.sh" ex w1
use_pack W1
pytest_log w1_heights "W1: the tile-height case" 40 "" \
  tests/test_bug_reports_thirtysecond_gpu.py::test_head_dim_64_tile_heights_give_the_same_bits
FAH_FWD_BLOCK_M=192 FAH_TEST_HEAD_DIM=64 pytest_log w1_wide "W1: forward files, 192-row tiles forced" 60 4 \
  --dist loadfile tests/test_fwd_gpu.py tests/test_varlen_gpu.py tests/test_features_gpu.py \
  tests/test_fwd_boundary_gpu.py
points() { fwd64_points $1 $2 192 4096,16384 20; }
points EX 1; points W1 1; points W1 2; points EX 2
