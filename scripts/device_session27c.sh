#!/usr/bin/env bash
# Session 27 call 3 (builds made on the CPU machine, in .prebuilt/pack/p.tar.xz): FINAL = the submitted kernels
# (session 25's full build), T = head_dim 64/128 bf16 with the ping-pong turn handed to the next consumer warpgroup
# once this warpgroup's S = Q Kᵀ has completed instead of right after its GEMMs are issued (all forward kernels).
# (1) The forward test files on T. (2) A/B FINAL against T, ROUNDS rounds, dense and softcap 30. (3) The benchmark's
# new dense references timed beside each feature point, on FINAL, head_dim 128, both directions.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
cp -f .prebuilt/T/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -x tests/test_fwd_gpu.py tests/test_features_gpu.py \
  tests/test_fwd_boundary_gpu.py 2>&1 | tail -n 5 | tee $OUT/pytest_T.log
CASES="FINAL;T" DIRECTION=fwd ROUNDS=${ROUNDS:-2} TAG=turn BACKENDS=ours \
  BENCH="--head-dims 128,64 --features dense,softcap --seqlens 1024,4096,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-260} bash scripts/device_env_ab.sh
cp -f .prebuilt/FINAL/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${ADJ_TIMEOUT:-150} python3 -m flash_attn_hopper.benchmark --head-dims 128 --seqlens 1024,16384 --no-bar \
  --features softcap,window,gqa,varlen,deterministic --backends ours --no-check --direction both \
  --json $OUT/adjacent.json --summary $OUT/adjacent_summary.md 2>&1 | grep -E "^\[|Error|error" | tail -n 30
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_after.txt
