#!/usr/bin/env bash
# Session 24, A/B of the backward's LSE prefetch (P4: head_dim 128, bf16 + fp16) against the head's kernels (W: head_dim
# 64/128 bf16), ours and cuDNN per process, ROUNDS rounds in reversed order; then every GPU test file on P4 (kernels
# of other head dims are not in that build: their tests skip). Builds in .prebuilt/pack/p.tar.xz.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
ls .prebuilt/*/
BUILDS="W P4" DIRECTION=bwd ROUNDS=${ROUNDS:-3} TAG=lse \
  BENCH="--head-dims 128 --features dense --seqlens 1024,4096,16384 --no-check;--head-dims 128 --features deterministic,gqa,varlen --seqlens 4096,16384 --causal no --no-check" \
  bash scripts/device_ab_prebuilt.sh
nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider $(ls tests/*_gpu.py | grep -v fwd_tiles) 2>&1 | tail -n 8 \
  | tee $OUT/pytest_P4.log
