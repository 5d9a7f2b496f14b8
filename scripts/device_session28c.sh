#!/usr/bin/env bash
# Session 28 call 3 (builds made on the CPU machine, head_dim 256 bf16 only): HS3 = the half-block skip chosen at run
# time inside the consumer (head_dim 256 only), B256 = the session's starting kernels (a3a2908). The skip tests and the
# forward test files on HS3 (head_dim 256 cases; the others skip as not built), then an A/B of B256, HS3 with
# FAH_FWD_SKIP_BLOCKS=0 and HS3, forward, causal and not, ROUNDS rounds, order reversed every other.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
cp -f .prebuilt/HS3/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${T1:-200} python3 -m pytest -q -p no:cacheprovider tests/test_fwd_skip_gpu.py tests/test_fwd_boundary_gpu.py \
  tests/test_fwd_gpu.py tests/test_features_gpu.py 2>&1 | tail -n 15 | tee $OUT/pytest_HS3.log
CASES="B256;HS3 FAH_FWD_SKIP_BLOCKS=0;HS3" DIRECTION=fwd ROUNDS=${ROUNDS:-2} TAG=skip256 BACKENDS=ours \
  BENCH="--head-dims 256 --features dense --seqlens 512,1024,2048,4096,16384 --no-check --no-adjacent" \
  timeout ${AB1:-330} bash scripts/device_env_ab.sh
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_after.txt
