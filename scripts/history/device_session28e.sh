#!/usr/bin/env bash
# Session 28 call 3 (builds made on the CPU machine, in .prebuilt/pack/p.tar.xz; bf16): two A/Bs against the
# session's starting kernels (a3a2908), ROUNDS rounds each, order reversed every other round, forward TFLOP/s.
# (1) B256 against HS3: head_dim 256 with the half-block skip as a run-time branch in the consumer, causal.
# (2) BQ against RQA: head_dim 64/128 whose persistent consumers take the Q buffer as a run-time index (one consumer
#     copy per kernel instead of one per buffer), dense both masks and softcap 30.
# The tests of both builds run in the final GPU check of the tree that keeps them (device_session28f.sh).
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
CASES="B256;HS3" DIRECTION=fwd ROUNDS=${ROUNDS:-2} TAG=skip256 BACKENDS=ours \
  BENCH="--head-dims 256 --causal yes --features dense --seqlens 512,1024,2048,4096,16384 --no-check --no-adjacent" \
  timeout ${AB1:-150} bash scripts/device_env_ab.sh
CASES="BQ;RQA" DIRECTION=fwd ROUNDS=${ROUNDS:-2} TAG=rq BACKENDS=ours \
  BENCH="--head-dims 64,128 --features dense,softcap --seqlens 512,1024,4096,16384 --no-check --no-adjacent" \
  timeout ${AB2:-330} bash scripts/device_env_ab.sh
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_after.txt
