#!/usr/bin/env bash
# Session 30 call 3: head_dim 64 builds (made on the CPU machine, carried in .prebuilt/pack/p.tar.xz): TW = the
# submitted kernels (its two-CTA kernel is not run: FAH_FWD64_TWIN unset), DL = the 128-row tiles taking the last
# visible key block (a causal tile's diagonal) after the others (FwdKernelTraits::kDiagonalLast; bf16 and fp16),
# SPL = the 128-row tiles with the mask-free interior loop (kSplitMaskLoop; bf16). The forward-side GPU test files on
# DL and SPL first, then a three-round A/B of the forward, both masks, 512-4096 (the launcher's tiles: 128 rows at
# causal 512-4096 and non-causal 512/1024; the 192-row points are the control).
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
for b in DL SPL; do
  cp -f .prebuilt/$b/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
  timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider -rf --timeout 100 \
    tests/test_fwd_gpu.py tests/test_fwd_boundary_gpu.py tests/test_features_gpu.py tests/test_varlen_gpu.py \
    tests/test_documents_gpu.py tests/test_head_dims_gpu.py tests/test_bug_reports_gpu.py \
    tests/test_bug_reports_more_gpu.py tests/test_bug_reports_third_gpu.py tests/test_fwd_tiles_gpu.py > $OUT/pytest_$b.log 2>&1
  echo "pytest $b rc $?"; tail -n 3 $OUT/pytest_$b.log
done
CASES="TW;DL;SPL" DIRECTION=fwd ROUNDS=${ROUNDS:-3} TAG=dl BACKENDS=ours \
  BENCH="--head-dims 64 --causal both --features dense --seqlens 512,1024,2048,4096 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-250} bash scripts/device_env_ab.sh
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_after.txt
