#!/usr/bin/env bash
# Session 42: the varlen forward at seqlen 1024 read 424 TFLOP/s (±11 %, 0.72 of dense timed beside) in the head's
# grid, against 547-576 in every earlier grid. A/B of the head's full build (VERIFY) against the builds before (GQA)
# and with (OVF) e96a90e's producer change, head_dim 128 bf16, varlen and dense at 1024 and 4096, 3 rounds.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for n in verify_so gqa ovf; do
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" .prebuilt/pack/$n.tar.xz || exit 1
done
CASES="VERIFY;GQA;OVF" DIRECTION=fwd ROUNDS=${ROUNDS:-3} TAG=varlen BACKENDS=ours \
  BENCH="--head-dims 128 --causal both --features ${FEATURES:-varlen,dense} --seqlens ${SEQLENS:-1024,4096} --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-400} bash scripts/device_env_ab.sh | tee $OUT/ab_varlen.txt
