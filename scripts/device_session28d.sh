#!/usr/bin/env bash
# Session 28 call 4 (builds made on the CPU machine, in .prebuilt/pack/p.tar.xz).
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before2.txt
# RQA = head_dim 64/128 bf16 whose persistent consumers take the Q buffer as a run-time index (one copy of the
# consumer per kernel instead of one per buffer; SASS instructions per kernel: head_dim 64 128-row tiles 2744-3280
# against 4464-5560, 192-row 3408-3912 against 5904-6888, head_dim 128 3832-4344 against 6592-7456), BQ = the
# session's starting kernels at the same widths. The forward test files on RQA (head_dim 64 with each tile height
# forced, then head_dim 128), then an A/B, forward.
cp -f .prebuilt/RQA/_C.abi3.so flash_attn_hopper/_C.abi3.so
for m in 128 192; do
  FAH_FWD_BLOCK_M=$m FAH_TEST_HEAD_DIM=64 timeout ${T2:-100} python3 -m pytest -q -p no:cacheprovider -x \
    tests/test_fwd_gpu.py tests/test_features_gpu.py tests/test_fwd_boundary_gpu.py 2>&1 | tail -n 5 \
    | tee $OUT/pytest_RQA_64_$m.log
done
FAH_TEST_HEAD_DIM=128 timeout ${T3:-120} python3 -m pytest -q -p no:cacheprovider -x \
  tests/test_fwd_gpu.py tests/test_features_gpu.py tests/test_fwd_boundary_gpu.py 2>&1 | tail -n 5 \
  | tee $OUT/pytest_RQA_128.log
CASES="BQ;RQA" DIRECTION=fwd ROUNDS=${ROUNDS:-2} TAG=rq BACKENDS=ours \
  BENCH="--head-dims 64,128 --features dense,softcap --seqlens 512,1024,2048,4096,16384 --no-check --no-adjacent" \
  timeout ${AB2:-330} bash scripts/device_env_ab.sh
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_after2.txt
