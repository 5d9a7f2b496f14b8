#!/usr/bin/env bash
# A/B over prebuilt extensions and environment settings in one device call: each ';'-separated CASES entry
# "BUILD ENV=VALUE..." (ENV optional, e.g. "F FAH_FWD_BLOCK_M=192") runs python -m flash_attn_hopper.benchmark $BENCH in
# its own process with .prebuilt/BUILD, for ROUNDS rounds (order reversed every other round), in the direction
# DIRECTION (fwd, the default, or bwd). Table lines on stdout, JSONs in $OUT/env_ab_$TAG.tar.gz.
set -u
export PYTHONUNBUFFERED=1
IFS=';' read -ra C <<< "$CASES"
D=/tmp/env_ab_${TAG:-x}; mkdir -p $D
for r in $(seq 1 ${ROUNDS:-2}); do
  order=("${C[@]}")
  if (( r % 2 == 0 )); then mapfile -t order < <(printf '%s\n' "${C[@]}" | tac); fi
  for c in "${order[@]}"; do
    read -r build envs <<< "$c"
    cp -f .prebuilt/$build/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
    name=$(echo "$c" | tr ' =' '__')
    echo "== round $r: $c"
    env ${envs:-X=1} timeout ${BENCH_TIMEOUT:-200} python3 -m flash_attn_hopper.benchmark $BENCH --direction ${DIRECTION:-fwd} \
      --backends ${BACKENDS:-ours} --no-bar --json $D/${name}_r$r.json 2>&1 | grep "^| " | cut -d'|' -f2-6
  done
done
tar czf $OUT/env_ab_${TAG:-x}.tar.gz -C /tmp env_ab_${TAG:-x}
