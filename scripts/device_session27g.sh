#!/usr/bin/env bash
# Session 27 call 7 (builds made on the CPU machine, in .prebuilt/pack/p.tar.xz): FINAL = the submitted kernels,
# S0 = head_dim 128 bf16 built with FAH_SPLIT_QK 0 (the fixed-maximum softcap's QKᵀ as one GEMM instead of two N = 64
# halves; session 11 measured the split at +1-3 % on the kernel of that time). (1) The forward test files on S0.
# (2) A/B of FINAL and S0, ROUNDS rounds, softcap 30 at head_dim 128.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
cp -f .prebuilt/S0/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider -x tests/test_fwd_gpu.py tests/test_features_gpu.py \
  tests/test_fwd_boundary_gpu.py 2>&1 | tail -n 3 | tee $OUT/pytest_S0.log
CASES="FINAL;S0" DIRECTION=fwd ROUNDS=${ROUNDS:-3} TAG=split_qk BACKENDS=ours \
  BENCH="--head-dims 128 --features softcap --seqlens 1024,4096,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-200} bash scripts/device_env_ab.sh
