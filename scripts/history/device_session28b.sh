#!/usr/bin/env bash
# Kept as a record: needs a build with the half-block skip, removed in c14cfef (patch in
# benchmarks/results/2026-12-03_h200_session28/fwd_half_skip_consumer_copies_NOT_KEPT.patch).
# Session 28 call 2: HS2 = HS with the peeled second key block of a skipping warpgroup masked only where the mask
# crosses it (as in the loop; forced masked, the fixed-maximum softcap took its rounding correction there too, which
# made call 1's bitwise test differ at head_dim 64 bf16 softcap 30). The skip tests on HS2, then an A/B of the skip
# (FAH_FWD_SKIP_BLOCKS=0 against the default), causal forward, head_dim 64 (the launcher's tiles, then 128-row tiles
# forced) and 256; ROUNDS rounds, order reversed every other.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
cp -f .prebuilt/HS2/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${T1:-120} python3 -m pytest -q -p no:cacheprovider tests/test_fwd_skip_gpu.py 2>&1 | tail -n 15 \
  | tee $OUT/pytest_HS2_skip.log
CASES="HS2 FAH_FWD_SKIP_BLOCKS=0;HS2" DIRECTION=fwd ROUNDS=${ROUNDS:-2} TAG=skip BACKENDS=ours \
  BENCH="--head-dims 64,256 --causal yes --features dense --seqlens 512,1024,2048,4096,16384 --no-check --no-adjacent" \
  timeout ${AB1:-300} bash scripts/device_env_ab.sh
CASES="HS2 FAH_FWD_SKIP_BLOCKS=0 FAH_FWD_BLOCK_M=128;HS2 FAH_FWD_BLOCK_M=128" DIRECTION=fwd ROUNDS=${ROUNDS:-2} \
  TAG=skip128 BACKENDS=ours \
  BENCH="--head-dims 64 --causal yes --features dense --seqlens 2048,4096,16384 --no-check --no-adjacent" \
  timeout ${AB2:-150} bash scripts/device_env_ab.sh
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_after.txt
