#!/usr/bin/env bash
# Session 27 call 4 (builds made on the CPU machine, in .prebuilt/pack/p.tar.xz): FINAL = the submitted kernels
# (session 25's full build), E = head_dim 64/128 bf16 with the ping-pong turn handed to the next consumer warpgroup
# right after this warpgroup's QKᵀ is issued, before its P V, instead of after both (all forward kernels; call 3's T,
# the turn handed over once S had completed, lost 8-10 % on softcap). (1) The forward test files on E. (2) A/B of
# FINAL, E and FINAL without ping-pong, ROUNDS rounds, dense and softcap 30.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
cp -f .prebuilt/E/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -x tests/test_fwd_gpu.py tests/test_features_gpu.py \
  tests/test_fwd_boundary_gpu.py 2>&1 | tail -n 5 | tee $OUT/pytest_E.log
CASES="FINAL;E;FINAL FAH_FWD_PINGPONG=0" DIRECTION=fwd ROUNDS=${ROUNDS:-2} TAG=turn_early BACKENDS=ours \
  BENCH="--head-dims 128,64 --features dense,softcap --seqlens 1024,4096,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-330} bash scripts/device_env_ab.sh
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_after.txt
