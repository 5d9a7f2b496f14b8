#!/usr/bin/env bash
# Session 26 call 4: the dQ writer warp hands each warpgroup's staging chunk back once TMA has read it, instead of
# once both are read (EF; head_dim 64/128 bf16 build made on the CPU machine) against session 24's head (W): the
# backward GPU test files on EF, then the backward A/B, ROUNDS rounds, one process per case.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
cp -f .prebuilt/EF/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_bwd_gpu.py \
  tests/test_bwd_gqa_group_gpu.py tests/test_features_gpu.py tests/test_documents_gpu.py tests/test_varlen_gpu.py \
  tests/test_bug_reports_gpu.py tests/test_deterministic_gpu.py 2>&1 | tail -n 4 | tee $OUT/pytest_EF.log
CASES="W;EF" DIRECTION=bwd ROUNDS=${ROUNDS:-3} TAG=ef BACKENDS=ours \
  BENCH="--head-dims 128,64 --features dense,gqa,varlen --seqlens 1024,4096,16384 --no-check" \
  timeout ${AB_TIMEOUT:-300} bash scripts/device_env_ab.sh
