#!/usr/bin/env bash
# Session 58's third timing call (DQEF = the head, cf14058, built in full here): two dQ accumulator copies (dq_lanes 2,
# forced by FAH_BWD_DQ_LANES=2) under a causal mask at head_dim 256, deterministic. Today bwd_dq_lanes gives 2 only
# without masks up to seqlen_k 8192. Reasoning: in one lane key block n waits for n + 1, which reaches each query block
# one tile earlier in its walk; in two lanes it waits for n + 2, two tiles earlier, and each queue is half as long.
# The turn waits are 16-19 % of the CTAs' time (session 57/58 traces). Predicted +3-8 % at 4096 and 16384 causal, less
# the second copy's zero fill and read (~3 % at 4096). Session 36's LN lost 1-5 % with two copies at head_dim 128,
# and session 55 lost them here under causal masks (-11 / -19 %): this prediction missed that (measured -12 to -19 %).
# Also non-causal 16384 (one copy today: seqlen_k > 8192). 2 rounds in alternating order; the deterministic tests
# with the copies forced, since their causal cases then run two lanes.
#   carry [".prebuilt/pack/dqef.tar.xz"]; OUT=$OUT bash scripts/history/device_session58c.sh
TAG=s58c source "$(dirname "$0")/device_packs.sh" dqef
use_pack DQEF
FAH_BWD_DQ_LANES=2 timeout 90 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_deterministic_gpu.py \
  > "$OUT/tests_lanes2.log" 2>&1
echo "tests with FAH_BWD_DQ_LANES=2 rc $?: $(tail -n 1 "$OUT/tests_lanes2.log")"
grep -m 10 "^FAILED" "$OUT/tests_lanes2.log"
points() {
  echo "== round $2: FAH_BWD_DQ_LANES=$1"
  env FAH_BWD_DQ_LANES=$1 GQA_DETERMINISTIC=1 GQA_CAUSAL=yes timeout 40 python3 scripts/gqa_bwd_points.py \
    1024,4096,16384 16 256 | grep -v "^#"
  env FAH_BWD_DQ_LANES=$1 GQA_DETERMINISTIC=1 GQA_CAUSAL=no timeout 40 python3 scripts/gqa_bwd_points.py \
    4096,16384 16 256 | grep -v "^#" | sed 's/$/ non-causal/'
}
for r in "1 2 1" "2 1 2"; do set -- $r; points $1 $3; points $2 $3; done 2>&1 | tee "$OUT/lanes_causal.txt"
echo "== default mode, beside"
GQA_CAUSAL=yes timeout 40 python3 scripts/gqa_bwd_points.py 1024,4096,16384 16 256 2>&1 | tee -a "$OUT/lanes_causal.txt"
