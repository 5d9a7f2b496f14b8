#!/usr/bin/env bash
# Session 28 call 4 (builds made on the CPU machine, in .prebuilt/pack/p.tar.xz).
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before2.txt
# RQ2 = head_dim 64/128 bf16 whose consumers take the Q buffer as a run-time index on head_dim 64's 128-row
# tiles and on head_dim 128 (one copy of the consumer per kernel instead of one per buffer: 2744-3280 SASS
# instructions per kernel against 4464-5560 at head_dim 64, 3832-4344 against 6592-7456 at 128), BQ = the session's
# starting kernels at the same widths. The forward test files on RQ2 (head_dim 64 with 128-row tiles forced, then
# head_dim 128), then an A/B, forward.
cp -f .prebuilt/RQ2/_C.abi3.so flash_attn_hopper/_C.abi3.so
FAH_FWD_BLOCK_M=128 FAH_TEST_HEAD_DIM=64 timeout ${T2:-120} python3 -m pytest -q -p no:cacheprovider -x \
  tests/test_fwd_gpu.py tests/test_features_gpu.py tests/test_fwd_boundary_gpu.py 2>&1 | tail -n 5 \
  | tee $OUT/pytest_RQ2_64.log
FAH_TEST_HEAD_DIM=128 timeout ${T3:-120} python3 -m pytest -q -p no:cacheprovider -x \
  tests/test_fwd_gpu.py tests/test_features_gpu.py tests/test_fwd_boundary_gpu.py 2>&1 | tail -n 5 \
  | tee $OUT/pytest_RQ2_128.log
CASES="BQ;RQ2" DIRECTION=fwd ROUNDS=${ROUNDS:-2} TAG=rq BACKENDS=ours \
  BENCH="--head-dims 64,128 --features dense --seqlens 512,1024,2048,4096 --no-check --no-adjacent" \
  timeout ${AB2:-200} bash scripts/device_env_ab.sh
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_after2.txt
