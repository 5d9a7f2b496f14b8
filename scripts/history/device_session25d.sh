#!/usr/bin/env bash
# Session 25, after the 80-row backward tiles were dropped: the tree's head_dim 64 build made on the CPU machine
# (.prebuilt/NP2, bf16 and fp16, from .prebuilt/pack/p.tar.xz; the only kernel change against session 24's head is
# the 128-row forward tiles without ping-pong) runs the forward test files at head_dim 64 (FAH_TEST_HEAD_DIM=64), the
# forced-tile tests and the no-ping-pong test; then the forward A/B of session 24's head (W) against it, ROUNDS rounds.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
cp -f .prebuilt/NP2/_C.abi3.so flash_attn_hopper/_C.abi3.so
FAH_TEST_HEAD_DIM=64 timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/test_fwd_gpu.py \
  tests/test_fwd_boundary_gpu.py tests/test_features_gpu.py tests/test_documents_gpu.py tests/test_varlen_gpu.py \
  tests/test_fwd_tiles_gpu.py 2>&1 | tail -n 8 | tee $OUT/pytest_NP2.log
BUILDS="W NP2" ROUNDS=${ROUNDS:-2} TAG=np \
  BENCH="--head-dims 64 --features dense --seqlens 512,1024,2048,4096 --causal yes --no-check;--head-dims 64 --features dense --seqlens 512,1024 --causal no --no-check" \
  timeout ${AB_TIMEOUT:-200} bash scripts/device_ab_prebuilt.sh
