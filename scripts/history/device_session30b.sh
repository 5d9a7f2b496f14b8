#!/usr/bin/env bash
# Session 30 call 2: head_dim 64's two-CTAs-per-SM forward (FwdTileConfig64Twin, FAH_FWD64_TWIN=1; experimental) on a
# head_dim 64 build (bf16, fp16) made on the CPU machine and carried in .prebuilt/pack/p.tar.xz as .prebuilt/TW.
# First the forward-side GPU test files with FAH_FWD64_TWIN=1 (head dims outside the build skip), then a three-round
# A/B of the forward, both masks, 512-16384, with the 128-row tiles forced (FAH_FWD_BLOCK_M=128), twin off / on.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
cp -f .prebuilt/TW/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
FAH_FWD64_TWIN=1 timeout ${TEST_TIMEOUT:-230} python3 -m pytest -q -p no:cacheprovider -rf --timeout 120 \
  tests/test_fwd_gpu.py tests/test_fwd_boundary_gpu.py tests/test_features_gpu.py tests/test_varlen_gpu.py \
  tests/test_documents_gpu.py tests/test_head_dims_gpu.py tests/test_bug_reports_gpu.py tests/test_bug_reports_more_gpu.py \
  tests/test_bug_reports_third_gpu.py > $OUT/pytest_twin.log 2>&1
echo "pytest rc $?"; tail -n 15 $OUT/pytest_twin.log
CASES="TW FAH_FWD_BLOCK_M=128 FAH_FWD64_TWIN=0;TW FAH_FWD_BLOCK_M=128 FAH_FWD64_TWIN=1" DIRECTION=fwd ROUNDS=${ROUNDS:-3} \
  TAG=twin BACKENDS=ours \
  BENCH="--head-dims 64 --causal both --features dense --seqlens 512,1024,2048,4096,8192,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-270} bash scripts/device_env_ab.sh
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_after.txt
