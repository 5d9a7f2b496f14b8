#!/usr/bin/env bash
# The next device session's first call (prepared in session 55; one warm machine, ~400 s; CPU-checked only). Session
# 55's H100 run found the GQA causal backward at head_dim 256 with groups of 8 (16 query heads on 2) at 0.62 of dense
# (149 against 240 TFLOP/s at 1024; gqa_hdim256.txt): bwd_heads_per_cta gives such grids group CTAs (8 heads per CTA,
# 512 CTAs at 1024), which the notes already saw lose to the fp32 sums at head_dim 128 causal 16/2 (session 52, H100).
# So: the launcher's choice against FAH_BWD_GQA_GROUP_CTA=0 (the sums), 2 rounds, causal and not, at head_dim 256
# (beside dense 16/16) and 128, groups of 8 and 4; then the grid (an H200's first since session 45, if one comes).
#   carry [".prebuilt/pack/s52.tar.xz"]; OUT=$OUT bash scripts/history/device_session55.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/s55}; mkdir -p "$OUT"
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/s52.tar.xz').extractall('.prebuilt')" || exit 1
cp -f .prebuilt/S52/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv | tee "$OUT/smi.txt"
CASES=("X=1" "FAH_BWD_GQA_GROUP_CTA=0")
for r in 1 2; do
  order=("${CASES[@]}")
  if (( r == 2 )); then mapfile -t order < <(printf '%s\n' "${CASES[@]}" | tac); fi
  for c in "${order[@]}"; do
    for causal in yes no; do
      echo "== round $r: $c causal=$causal"
      env $c GQA_CAUSAL=$causal timeout 40 python3 scripts/gqa_bwd_points.py 1024,2048,4096 16,4,2 256
      env $c GQA_CAUSAL=$causal timeout 30 python3 scripts/gqa_bwd_points.py 1024,2048,4096 4,2 128
    done
  done
done > "$OUT/gqa_group_vs_sums.txt" 2>&1
echo "gqa group/sums done"
timeout ${GRID_S:-150} python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 --direction both --no-bar \
  --json "$OUT/grid_S52.json" --summary "$OUT/grid_S52_summary.md" > "$OUT/grid.log" 2>&1
echo "grid rc $?"
