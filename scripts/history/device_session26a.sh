#!/usr/bin/env bash
# Session 26 call 1: the backward's dQ tiles added by the consumers with 16-byte reductions from registers instead of
# the writer warp's TMA reduce-add from shared memory (FAH_BWD_DQ_ATOMIC). Builds made on the CPU machine (head_dim
# 64/128 bf16, in .prebuilt/pack/p.tar.xz): W = session 24's head (the submitted backward), AT = the tree with the
# switch. The backward GPU test files on AT with the reductions, then the A/B, ROUNDS rounds, one process per case.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
cp -f .prebuilt/AT/_C.abi3.so flash_attn_hopper/_C.abi3.so
FAH_BWD_DQ_ATOMIC=1 timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider tests/test_bwd_gpu.py \
  tests/test_bwd_gqa_group_gpu.py tests/test_features_gpu.py tests/test_documents_gpu.py tests/test_varlen_gpu.py \
  tests/test_bug_reports_gpu.py tests/test_head_dims_gpu.py 2>&1 | tail -n 12 | tee $OUT/pytest_AT.log
CASES="W;AT FAH_BWD_DQ_ATOMIC=1;AT FAH_BWD_DQ_ATOMIC=0" DIRECTION=bwd ROUNDS=${ROUNDS:-2} TAG=dqat BACKENDS=ours \
  BENCH="--head-dims 128,64 --features dense --seqlens 1024,4096,16384 --no-check" \
  timeout ${AB_TIMEOUT:-330} bash scripts/device_env_ab.sh
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_after.txt
