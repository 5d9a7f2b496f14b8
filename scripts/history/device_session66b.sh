#!/usr/bin/env bash
# Session 66, call B: the tree's kernels with head_dim 64's 128-row tiles summing a row in four chains, as the
# 192-row tiles do (pack SC), against EX (73e371d). On SC: round 32's GPU file (with the tile-height case) and the
# files that exercise the exact pass; the forward test files with 128-row tiles forced at head_dim 64 (the kernel that
# changed); then the forward at head_dim 64, 128 rows forced, bf16, in the order EX, SC, SC, EX (predicted level:
# the same instructions, the sum's chains after the exponentials). Worst case of the limits: 300 s.
#   carry [".prebuilt/pack/ex.tar.xz", ".prebuilt/pack/sc.tar.xz"]
TAG=s66b source "$(dirname "$0")/device_packs.sh" ex sc
use_pack SC
pytest_log sc_round32 "SC: round 32 and the exact-pass files" 80 4 --dist loadfile \
  tests/test_bug_reports_thirtysecond_gpu.py tests/test_bug_reports_thirtyfirst_gpu.py \
  tests/test_bug_reports_fifth_gpu.py tests/test_kernel_edges_twelfth_gpu.py
FAH_FWD_BLOCK_M=128 FAH_TEST_HEAD_DIM=64 pytest_log sc_narrow "SC: forward files, 128-row tiles forced" 80 4 \
  --dist loadfile tests/test_fwd_gpu.py tests/test_varlen_gpu.py tests/test_features_gpu.py \
  tests/test_fwd_boundary_gpu.py
points() { fwd64_points $1 $2 128 1024,4096 25; }
points EX 1; points SC 1; points SC 2; points EX 2
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$OUT/smi_s66b.txt"
