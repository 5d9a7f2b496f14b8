#!/usr/bin/env bash
# The deterministic backward's dQ writer awaiting its turn before the tile's chunks are ready (dqpoll_lost.patch, DP
# pack FAH_HDIMS=128,256 bf16) against S56, and the DX pack's FAH_BWD_DEBUG=2 (turn waits kept, no wait for the
# reductions to complete before the release: a wrong order, timing only). Session 57's DX probe (H100, head_dim 256
# causal 16/16): deterministic 312 / 340 TFLOP/s at 4096 / 16384 against 357-360 / 380-386 without turn waits and
# 372-377 / 409-412 by default. Predicted for DP: one poll round trip less per tile and hand-over, +2-6 % at
# head_dim 256 causal.
#   carry [".prebuilt/pack/s56.tar.xz", ".prebuilt/pack/dp.tar.xz", ".prebuilt/pack/dx.tar.xz"]
TAG=dp source "$(dirname "$0")/device_packs.sh" s56 dp dx
use_pack DP
timeout ${TESTS_S:-100} python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_deterministic_gpu.py \
  tests/test_bwd_gpu.py -k "eterministic" > "$OUT/tests_DP.log" 2>&1
echo "DP tests rc $?: $(tail -n 1 "$OUT/tests_DP.log")"; grep -m 20 "^FAILED" "$OUT/tests_DP.log"
for r in 1 2; do
  order=(S56 DP DX2); (( r == 2 )) && order=(DX2 DP S56)
  for b in "${order[@]}"; do
    if [[ $b == DX2 ]]; then use_pack DX; export FAH_BWD_DEBUG=2; else use_pack $b; unset FAH_BWD_DEBUG; fi
    echo "== round $r: $b"
    GQA_DETERMINISTIC=1 GQA_CAUSAL=yes timeout 40 python3 scripts/gqa_bwd_points.py 4096,16384 16 256 | grep -v "^#"
    [[ $b == DX2 ]] || GQA_DETERMINISTIC=1 timeout 60 python3 scripts/gqa_bwd_points.py 4096,16384 16 128 | grep -v "^#"
  done
done 2>&1 | tee "$OUT/dp_ab.txt"
