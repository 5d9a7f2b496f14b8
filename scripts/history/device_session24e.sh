#!/usr/bin/env bash
# Session 24: head_dim 64's 128-row tiles without ping-pong by configuration (NP, head_dim 64 bf16) against the head
# (W), the launcher's own tile choice, ROUNDS rounds in reversed order (ours and cuDNN per process); then the forward
# GPU test files on NP (other head dims are not in that build: their tests skip).
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
BUILDS="W NP" ROUNDS=${ROUNDS:-2} TAG=np \
  BENCH="--head-dims 64 --features dense --seqlens 512,1024,2048,4096 --causal yes --no-check;--head-dims 64 --features dense --seqlens 512,1024 --causal no --no-check" \
  bash scripts/device_ab_prebuilt.sh
cp -f .prebuilt/NP/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${TEST_TIMEOUT:-110} python3 -m pytest -q -p no:cacheprovider tests/test_fwd_gpu.py tests/test_fwd_boundary_gpu.py tests/test_fwd_tiles_gpu.py \
  tests/test_varlen_gpu.py tests/test_features_gpu.py tests/test_documents_gpu.py \
  2>&1 | tail -n 4 | tee $OUT/pytest_NP.log
