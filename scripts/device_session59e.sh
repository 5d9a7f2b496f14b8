#!/usr/bin/env bash
# Session 59's last call, refused (too little budget left to start a machine): device_session59d.sh cut to one A/B
# round and the pairs' tests; packs as there.
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/dqp2.tar.xz"]
TAG=s59e source "$(dirname "$0")/device_packs.sh" dqef dqp2
for b in DQEF DQP2; do
  use_pack $b; echo "== $b"
  for c in yes no; do GQA_CAUSAL=$c timeout 25 python3 scripts/gqa_bwd_points.py 4096,16384 16 256 | grep -v "^#"; done
  GQA_DETERMINISTIC=1 GQA_CAUSAL=yes timeout 25 python3 scripts/gqa_bwd_points.py 4096,16384 16 256 | grep -v "^#" \
    | sed 's/$/ deterministic/'
done 2>&1 | tee "$OUT/dqp2_ab.txt"
timeout ${TEST_S:-60} python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_dq_pair_gpu.py \
  > "$OUT/tests_DQP2.log" 2>&1
echo "tests rc $?: $(tail -n 1 "$OUT/tests_DQP2.log")"
grep -m 10 "^FAILED\|^ERROR" "$OUT/tests_DQP2.log"
