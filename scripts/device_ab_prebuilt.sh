#!/usr/bin/env bash
# Forward A/B of extension builds made on the CPU machine and carried in .prebuilt/NAME/_C.abi3.so, in one device
# call: for ROUNDS rounds (order reversed every other round), each build in its own process runs each benchmark line
# of BENCH (';'-separated arguments of python -m flash_attn_hopper.benchmark, ours and cuDNN in the same process).
# Then the GPU tests selected by TESTS / TEST_K on the last build of BUILDS, and any POST command. Results in $OUT
# (the benchmark JSONs in ab_json_TAG.tar.gz).
#   BUILDS="A64 B"  BENCH="--head-dims 64 --features dense;--head-dims 128 --features dense,softcap"
# TAG: a prefix for the JSON names, so that two invocations in one call do not overwrite each other's.
set -u
export PYTHONUNBUFFERED=1
read -ra NAMES <<< "${BUILDS:-A B}"
IFS=';' read -ra LINES <<< "${BENCH:---head-dims 64 --features dense}"
for r in $(seq 1 ${ROUNDS:-2}); do
  order=("${NAMES[@]}")
  if (( r % 2 == 0 )); then order=($(printf '%s\n' "${NAMES[@]}" | tac)); fi
  for name in "${order[@]}"; do
    cp -f .prebuilt/$name/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
    i=0
    for line in "${LINES[@]}"; do
      echo "== round $r build $name: $line"
      timeout ${BENCH_TIMEOUT:-200} python3 -m flash_attn_hopper.benchmark $line --direction ${DIRECTION:-fwd} \
        --backends ours,cudnn --no-bar --json $OUT/ab_${name}_r${r}_${TAG:-}$i.json 2>&1 | grep "^| " | cut -d'|' -f2-9
      i=$((i + 1))
    done
  done
done
cp -f .prebuilt/${NAMES[-1]}/_C.abi3.so flash_attn_hopper/_C.abi3.so
if [ -n "${TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q $TESTS -k "${TEST_K:-bf16}" -p no:cacheprovider 2>&1 \
    | tail -n 8 | tee $OUT/pytest_${NAMES[-1]}.log
fi
if [ -n "${POST:-}" ]; then bash -c "$POST"; fi
# Only 8 files come back from a device call: the JSONs travel as one archive.
(cd $OUT && ls ab_*.json > /dev/null 2>&1 && tar czf ab_json_${TAG:-}.tar.gz ab_*.json && rm -f ab_*.json)
