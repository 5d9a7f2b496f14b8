#!/usr/bin/env bash
# The next device session's first two calls (prepared in session 56; CPU-checked only): PART=1 (~330 s) the GQA
# follow-up and round 26, PART=2 (~350 s) the profile and the grid.
# PART=1: the GQA rule's unmeasured cases (config.hpp bwd_heads_per_cta, 7b8703e): head_dim 256 causal 16/2 at 8192
#   and 16384, and the deterministic mode at 1024-4096, the rule (sums) against FAH_BWD_GQA_GROUP_CTA=1, 2 rounds;
#   then the twenty-sixth bug-report round's GPU file; then how much of the deterministic head_dim 256 causal backward's
#   gap (0.83 of the default on the H100) is its CTA order: deterministic mode runs the grid's order, the default
#   mode L2 sections (FAH_BWD_SECTION_MIB=0 gives the default mode the grid's order too), dense 16/16, 1 round.
# PART=2: Nsight Compute on the forward at head_dim 64, dense and softcap, and head_dim 128 dense (exp2 on the FMA pipe
#   lost 8-22 %, so the consumers are not MUFU-bound as counted: issue slots, pipe utilisation and stall reasons decide
#   the next softmax idea; softcap at head_dim 64 runs at 0.72-0.75 of dense); then the grid (an H200's first since
#   session 45, if one comes).
#   carry [".prebuilt/pack/s56.tar.xz"]; PART=1 OUT=$OUT bash scripts/history/device_session57.sh, then PART=2
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/s57}; mkdir -p "$OUT"
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/s56.tar.xz').extractall('.prebuilt')" || exit 1
cp -f .prebuilt/S56/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv | tee "$OUT/smi.txt"
if [[ ${PART:-1} == 1 ]]; then
for r in 1 2; do
  order=("X=1" "FAH_BWD_GQA_GROUP_CTA=1"); (( r == 2 )) && order=("FAH_BWD_GQA_GROUP_CTA=1" "X=1")
  for c in "${order[@]}"; do
    echo "== round $r: $c"
    env $c GQA_CAUSAL=yes timeout 60 python3 scripts/gqa_bwd_points.py 8192,16384 16,2 256
    env $c GQA_CAUSAL=yes GQA_DETERMINISTIC=1 timeout 60 python3 scripts/gqa_bwd_points.py 1024,4096 16,2 256
  done
done > "$OUT/gqa_rule_followup.txt" 2>&1
echo "gqa follow-up done"; cat "$OUT/gqa_rule_followup.txt"
# The twenty-sixth bug-report round's GPU file (52 tests, never run on a GPU).
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_bug_reports_twentysixth_gpu.py \
  > "$OUT/round26.log" 2>&1
echo "round 26 rc $?: $(tail -n 1 "$OUT/round26.log")"; grep -m 10 "^FAILED" "$OUT/round26.log"
for c in "X=1" "FAH_BWD_SECTION_MIB=0" "GQA_DETERMINISTIC=1"; do
  echo "== $c"; env $c GQA_CAUSAL=yes timeout 40 python3 scripts/gqa_bwd_points.py 4096,16384 16 256
done 2>&1 | tee "$OUT/det_order.txt"
exit 0
fi
CASES="64 16384 dense;64 16384 softcap;128 16384 dense" TAG=fwd64 NCU_TIMEOUT=90 OUT=$OUT bash scripts/ncu_fwd.sh
timeout ${GRID_S:-150} python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 --direction both --no-bar \
  --json "$OUT/grid_S56.json" --summary "$OUT/grid_S56_summary.md" > "$OUT/grid.log" 2>&1
echo "grid rc $?"
