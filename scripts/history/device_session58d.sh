#!/usr/bin/env bash
# Session 58's last timing call: DQL (dql_lost.patch on cf14058, head_dim 256 bf16 pack): the head_dim 256
# consumers await the writer's DQEmpty after the first dQ pass's GEMM, not before it (DQE, landed, put it after the
# dV / dK issue). The tensor cores then run one more GEMM while the writer waits for its turn; the previous tile's Q
# stage goes back to the producer that much later. Predicted: deterministic +1-4 %, default mode level (+-1 %).
# The deterministic and backward tests on DQL, then 2 rounds in alternating order against DQEF (the head in full).
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/dql.tar.xz"]; OUT=$OUT bash scripts/history/device_session58d.sh
TAG=s58d source "$(dirname "$0")/device_packs.sh" dqef dql
use_pack DQL
timeout 60 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_deterministic_gpu.py tests/test_bwd_gpu.py \
  > "$OUT/tests_DQL.log" 2>&1
echo "DQL tests rc $?: $(tail -n 1 "$OUT/tests_DQL.log")"; grep -m 10 "^FAILED" "$OUT/tests_DQL.log"
points() {
  use_pack $1
  echo "== round $2: $1"
  for c in yes no; do
    GQA_DETERMINISTIC=1 GQA_CAUSAL=$c timeout 40 python3 scripts/gqa_bwd_points.py 4096,16384 16 256 \
      | grep -v "^#" | sed 's/$/ deterministic/'
    GQA_CAUSAL=$c timeout 40 python3 scripts/gqa_bwd_points.py 4096,16384 16 256 | grep -v "^#" | sed 's/$/ default/'
  done
}
for r in "DQEF DQL 1" "DQL DQEF 2"; do set -- $r; points $1 $3; points $2 $3; done 2>&1 | tee "$OUT/dql_ab.txt"
