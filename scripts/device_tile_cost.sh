#!/usr/bin/env bash
# The forward's per-tile cost on a prebuilt extension (.prebuilt/$BUILD): scripts/tile_cost.py at a fixed tile count,
# then dense points with the persistent threshold as built, forced on (FAH_FWD_PERSISTENT_MAX_KEY_BLOCKS=100000) and off
# (FAH_FWD_PERSISTENT=0), and causal too when CAUSAL is set. Output in $OUT/tile_cost_$BUILD.log.
set -u
export PYTHONUNBUFFERED=1
cp -f .prebuilt/${BUILD:-B}/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
L=$OUT/tile_cost_${BUILD:-B}.log
{
  [ -n "${SKIP_FIT:-}" ] || python3 scripts/tile_cost.py 1024 16
  [ -n "${SKIP_FIT:-}" ] || python3 scripts/tile_cost.py 2048 8
  for env in "X=1" "FAH_FWD_PERSISTENT_MAX_KEY_BLOCKS=100000" "FAH_FWD_PERSISTENT=0"; do
    echo "== $env"
    env $env python3 scripts/tile_cost.py --dense ${DENSE:-1024,2048,4096,8192,16384}
    [ -z "${CAUSAL:-}" ] || env $env python3 scripts/tile_cost.py --dense ${DENSE:-1024,2048,4096,8192,16384} --causal
  done
} 2>&1 | tee $L
