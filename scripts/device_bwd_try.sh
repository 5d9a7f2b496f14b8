#!/usr/bin/env bash
# One device call for a backward change: a development build (FAH_HDIMS, bf16) from a clean tree, the backward
# benchmark lines of BENCH (';'-separated, ours and cuDNN in one process each; BENCH=none skips them), the GPU tests
# TESTS / TEST_K, Nsight Compute of the backward's main kernel for each case of CASES (scripts/ncu_fwd.sh, e.g.
# "256 16384 dense bwd;256 4096 dense causal bwd") and, with BREAKDOWN="HEAD_DIMS SEQLENS", scripts/bwd_breakdown.py.
# Results in $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source scripts/device_dev_build.sh
IFS=';' read -ra LINES <<< "${BENCH:---head-dims 256}"
i=0
[ "${BENCH:-}" == none ] && LINES=()
for line in "${LINES[@]}"; do
  timeout ${BENCH_TIMEOUT:-200} python3 -m flash_attn_hopper.benchmark $line --direction bwd --backends ours,cudnn \
    --no-bar --json $OUT/bench_${TAG:-try}_$i.json 2>&1 | grep "^| " | cut -d'|' -f2-12
  i=$((i + 1))
done
if [ -n "${TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x $TESTS -k "${TEST_K:-not fp16}" -p no:cacheprovider \
    > $OUT/pytest_${TAG:-try}.log 2>&1
  tail -n 12 $OUT/pytest_${TAG:-try}.log
fi
if [ -n "${CASES:-}" ]; then
  KERNEL=flash_bwd_sm90_kernel TAG=${TAG:-try} CASES="$CASES" bash scripts/ncu_fwd.sh
fi
[ -z "${BREAKDOWN:-}" ] || python3 scripts/bwd_breakdown.py $BREAKDOWN 2>&1 | tee $OUT/bwd_breakdown.log
