#!/usr/bin/env bash
# Prepared in session 60, not run (no machine came; the budget fell below a start). The twenty-eighth bug-report
# round's GPU file on DQEF (the head's C++), then why two dQ copies lost under a causal mask (sessions 55 and 58:
# deterministic head_dim 256 causal -11 to -19 %): the turn waits traced with one copy and with two (TRACE pack =
# bwd_trace_probe_UNRUN.patch on session 57's head; the lanes code is the same in DQEF), head_dim 256 causal 4096 and
# 16384. If the waits fall with two copies while the kernel span grows, the cost is elsewhere (memory), not the chain.
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/trace.tar.xz"]
TAG=s60e source "$(dirname "$0")/device_packs.sh" dqef trace
use_pack DQEF
timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_bug_reports_twentyeighth_gpu.py \
  > "$OUT/round28.log" 2>&1
echo "round 28 rc $?: $(tail -n 1 "$OUT/round28.log")"
grep -m 15 "^FAILED\|^ERROR" "$OUT/round28.log"
use_pack TRACE
for lanes in 1 2; do
  for s in 4096 16384; do FAH_BWD_DQ_LANES=$lanes timeout 60 python3 scripts/bwd_trace.py 256 $s causal \
    | sed "s/^/lanes $lanes: /"; done
done 2>&1 | tee "$OUT/lanes_trace.txt"
