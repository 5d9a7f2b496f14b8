#!/usr/bin/env bash
# Session 52 call 3: the GQA group CTAs' sections of one wave (S52 = branch wave's C++, every kernel). The GPU files
# that exercise the backward's CTA orders (the GQA files under each forced mode and order, the sections' partial-last
# tests, the new wave-section test), then the A/B against S51 (one global order) and the group CTA forced at 16/2,
# then the grid with the feature rows.
#   carry [".prebuilt/pack/s51.tar.xz", ".prebuilt/pack/s52.tar.xz"]; OUT=$OUT bash scripts/history/device_session52_3.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/s52_3}; mkdir -p "$OUT"
python3 -c "import tarfile; [tarfile.open(f'.prebuilt/pack/{s}.tar.xz').extractall('.prebuilt') for s in ('s51', 's52')]" || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
cp -f .prebuilt/S52/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1

timeout ${TEST_S:-250} python3 -m pytest -q -p no:cacheprovider tests/test_sections_gpu.py tests/test_bwd_gqa_group_gpu.py \
  --junitxml="$OUT/junit_wave.xml" > "$OUT/tests_wave.log" 2>&1
echo "wave tests rc $?"; tail -3 "$OUT/tests_wave.log"

CASES=("S52 X=1" "S51 X=1" "S52 FAH_BWD_GQA_GROUP_CTA=1")
for r in 1 2; do
  order=("${CASES[@]}")
  if (( r == 2 )); then mapfile -t order < <(printf '%s\n' "${CASES[@]}" | tac); fi
  for c in "${order[@]}"; do
    read -r build envs <<< "$c"
    cp -f .prebuilt/$build/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
    echo "== round $r: $c"
    env $envs GQA_CAUSAL=yes timeout 40 python3 scripts/gqa_bwd_points.py 1024,2048,4096 16,4,2 128
    env $envs GQA_CAUSAL=yes timeout 40 python3 scripts/gqa_bwd_points.py 1024,2048,4096 4,2 64
  done
done > "$OUT/gqa_wave_ab.txt" 2>&1
echo "a/b done"

cp -f .prebuilt/S52/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
timeout ${GRID_S:-150} python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 --direction both --no-bar \
  --json "$OUT/grid_S52.json" --summary "$OUT/grid_S52_summary.md" > "$OUT/grid.log" 2>&1
echo "grid rc $?"
