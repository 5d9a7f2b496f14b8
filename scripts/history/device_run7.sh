#!/usr/bin/env bash
# One device call (~6 min): scripts/history/device_run4.sh (clean build, SASS, all GPU tests, benchmark grid with feature
# points), then on that build a forward A/B of the variants in AB (env assignments separated by ';', default: the
# head_dim 64 tile heights forced) at the head dims AB_HDIMS (default 64,128), ours only.
set -u
CHECK_TIMEOUT=${CHECK_TIMEOUT:-440} bash scripts/history/device_run4.sh 2>&1 | grep -v "^| \(varlen\|window\|softcap\|gqa\|deterministic\) " | tail -n 40
IFS=';' read -ra VARIANTS <<< "${AB:-FAH_FWD_BLOCK_M=128;FAH_FWD_BLOCK_M=192}"
i=0
for v in "${VARIANTS[@]}"; do
  echo "== variant $i: $v"
  env $v PYTHONPATH=$PWD timeout 150 python3 -m flash_attn_hopper.benchmark --head-dims ${AB_HDIMS:-64,128} --direction fwd \
    --features dense --backends ours --no-bar --no-check --json $OUT/ab_$i.json > /tmp/ab_$i.log 2>&1
  echo "rc $?"
  i=$((i+1))
done
ls $OUT
