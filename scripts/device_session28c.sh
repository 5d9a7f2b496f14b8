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
# Part 2: RQ = head_dim 64 bf16 whose 128-row tiles' consumer takes its Q buffer as a run-time index (one copy of the
# consumer instead of one per buffer: 2744-3280 SASS instructions per kernel against 4464-5560), B64 = the session's
# starting kernels. The forward test files on RQ with 128-row tiles forced, then an A/B, head_dim 64 forward.
cp -f .prebuilt/RQ/_C.abi3.so flash_attn_hopper/_C.abi3.so
FAH_FWD_BLOCK_M=128 FAH_TEST_HEAD_DIM=64 timeout ${T2:-150} python3 -m pytest -q -p no:cacheprovider -x \
  tests/test_fwd_gpu.py tests/test_features_gpu.py tests/test_fwd_boundary_gpu.py tests/test_varlen_gpu.py 2>&1 \
  | tail -n 5 | tee $OUT/pytest_RQ.log
CASES="B64;RQ" DIRECTION=fwd ROUNDS=${ROUNDS:-2} TAG=rq BACKENDS=ours \
  BENCH="--head-dims 64 --features dense --seqlens 512,1024,2048,4096 --no-check --no-adjacent" \
  timeout ${AB2:-200} bash scripts/device_env_ab.sh
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_after2.txt
