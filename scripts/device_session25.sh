#!/usr/bin/env bash
# Session 25, builds made on the CPU machine (.prebuilt/pack/p.tar.xz): R80 (this tree, head_dim 64/128 bf16:
# head_dim 128's 80-row backward tiles without a mask, head_dim 64's 128-row forward tiles without ping-pong) and W
# (session 24's head). PART=1: R80's backward tests (tiles forced both ways over the backward test files, the backward
# test file as chosen), then the backward A/B at head_dim 128 without a mask, 64 rows (FAH_BWD_BLOCK_M=64) against 80.
# PART=2 (the machine still warm): causal 64 rows against 80 forced; the forward without ping-pong test (head_dim 64)
# and the forward A/B of W against R80 (head_dim 64, the launcher's tiles).
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
cp -f .prebuilt/R80/_C.abi3.so flash_attn_hopper/_C.abi3.so
if [[ ${PART:-1} == 1 ]]; then
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider tests/test_bwd_tiles_gpu.py tests/test_bwd_gpu.py \
    2>&1 | tail -n 30 | tee $OUT/pytest_R80_bwd.log
  CASES="R80 FAH_BWD_BLOCK_M=64;R80" DIRECTION=bwd ROUNDS=${ROUNDS:-2} TAG=bwd80 BACKENDS=ours,cudnn \
    BENCH="--head-dims 128 --features dense --seqlens 1024,2048,4096,8192,16384 --causal no --no-check" \
    bash scripts/device_env_ab.sh
else
  CASES="R80;R80 FAH_BWD_BLOCK_M=80" DIRECTION=bwd ROUNDS=${ROUNDS:-2} TAG=bwd80c BACKENDS=ours \
    BENCH="--head-dims 128 --features dense --seqlens 1024,4096,16384 --causal yes --no-check" \
    bash scripts/device_env_ab.sh
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider \
    "tests/test_fwd_tiles_gpu.py::test_forward_without_pingpong_passes_the_forward_tests[64]" \
    2>&1 | tail -n 30 | tee $OUT/pytest_R80_fwd.log
  BUILDS="W R80" ROUNDS=${ROUNDS:-2} TAG=np \
    BENCH="--head-dims 64 --features dense --seqlens 512,1024,2048,4096 --causal yes --no-check;--head-dims 64 --features dense --seqlens 512,1024 --causal no --no-check" \
    bash scripts/device_ab_prebuilt.sh
fi
