#!/usr/bin/env bash
# Session 28 call 2: A/B of the half-block skip on HS (FAH_FWD_SKIP_BLOCKS=0 against the default), causal forward,
# head_dim 64 (the launcher's tiles, then 128-row tiles forced) and 256; ROUNDS rounds, order reversed every other.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
CASES="HS FAH_FWD_SKIP_BLOCKS=0;HS" DIRECTION=fwd ROUNDS=${ROUNDS:-2} TAG=skip BACKENDS=ours \
  BENCH="--head-dims 64,256 --causal yes --features dense --seqlens 512,1024,2048,4096,16384 --no-check --no-adjacent" \
  timeout ${AB1:-300} bash scripts/device_env_ab.sh
CASES="HS FAH_FWD_SKIP_BLOCKS=0 FAH_FWD_BLOCK_M=128;HS FAH_FWD_BLOCK_M=128" DIRECTION=fwd ROUNDS=${ROUNDS:-2} \
  TAG=skip128 BACKENDS=ours \
  BENCH="--head-dims 64 --causal yes --features dense --seqlens 2048,4096,16384 --no-check --no-adjacent" \
  timeout ${AB2:-150} bash scripts/device_env_ab.sh
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_after.txt
