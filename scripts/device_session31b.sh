#!/usr/bin/env bash
# Prepared in session 30 for the next one (not run yet): the forward mask with one compare per element where no row
# of a thread has a left limit in the block (Window::apply<kOneSided>, two-consumer kernels only; the causal diagonal
# and seqlen_k's cut: 64 ISETP + 64 FSEL per masked head_dim 64/128 block instead of 128 ISETP + 64 FSEL + 34 VIADD;
# benchmarks/results/2026-12-03_h200_session30/fwd_mask_one_sided_UNTESTED.patch). Builds made on the CPU machine and
# carried in .prebuilt/pack/p.tar.xz: CT = the submitted kernels (session 29's full build; SASS equal to 3182d08's),
# MK = the patch (head_dim 64 and 128, bf16). Forward-side GPU test files on MK first, then three rounds of the
# forward at head_dim 64/128 with the window and softcap points, CT / MK alternating.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
cp -f .prebuilt/MK/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -rf --timeout 100 \
  tests/test_fwd_gpu.py tests/test_fwd_boundary_gpu.py tests/test_features_gpu.py tests/test_varlen_gpu.py \
  tests/test_documents_gpu.py tests/test_head_dims_gpu.py tests/test_bug_reports_gpu.py \
  tests/test_bug_reports_more_gpu.py tests/test_bug_reports_third_gpu.py > $OUT/pytest_MK.log 2>&1
echo "pytest MK rc $?"; tail -n 3 $OUT/pytest_MK.log
CASES="CT;MK" DIRECTION=fwd ROUNDS=${ROUNDS:-3} TAG=mk BACKENDS=ours \
  BENCH="--head-dims 64,128 --causal both --features dense,window,softcap --seqlens 512,1024,2048,4096,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-330} bash scripts/device_env_ab.sh
