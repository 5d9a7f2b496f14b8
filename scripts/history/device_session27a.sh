#!/usr/bin/env bash
# Session 27 call 1: where the head_dim 64 causal forward loses against its non-causal speed (466 against 513 at
# 16384 in session 26's grid; FlashAttention-4's sm90 path loses 4 % there). One prebuilt extension (.prebuilt/FINAL,
# session 25's full build of the submitted kernels, from .prebuilt/pack/p.tar.xz), four launcher settings by
# environment: the default, every tile persistent (FAH_FWD_PERSISTENT_MAX_KEY_BLOCKS large: today a causal tile that
# sees more than 32 key blocks runs one CTA per tile), 128-row tiles at head_dim 64, and both. ROUNDS rounds, one
# process per case, order reversed every other round.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
P=FAH_FWD_PERSISTENT_MAX_KEY_BLOCKS=100000
CASES="FINAL;FINAL $P;FINAL FAH_FWD_BLOCK_M=128;FINAL FAH_FWD_BLOCK_M=128 $P" DIRECTION=fwd ROUNDS=${ROUNDS:-2} \
  TAG=persist BACKENDS=ours BENCH="--head-dims 64,128 --features dense --seqlens 4096,16384 --no-check" \
  timeout ${AB_TIMEOUT:-400} bash scripts/device_env_ab.sh
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_after.txt
