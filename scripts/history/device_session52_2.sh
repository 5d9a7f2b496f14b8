#!/usr/bin/env bash
# S51 pack only: FAH_BWD_GQA_GLOBAL_ORDER, used below, was replaced by FAH_BWD_GQA_ORDER in f798bcd (session 52).
# Session 52 call 2: the GQA causal backward's section size. Call 1 (H100) had the group CTAs in one longest-first
# order at 0.73 of dense at 1024 (225 TFLOP/s) against 289 in 24 MiB sections. A makespan model (sections of about
# one wave of CTAs: 0.97-1.00 of ideal, with half the live pairs of one section) suggests sections of ~SMs CTAs; these
# are FAH_BWD_SECTION_MIB 64 at head_dim 128 and 32 at head_dim 64 for 16k tokens. The S51 pack, env cases only.
#   carry [".prebuilt/pack/s51.tar.xz"]; OUT=$OUT bash scripts/history/device_session52_2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/s52_2}; mkdir -p "$OUT"
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/s51.tar.xz').extractall('.prebuilt')" || exit 1
cp -f .prebuilt/S51/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
CASES=("X=1" "FAH_BWD_GQA_GLOBAL_ORDER=0" "FAH_BWD_GQA_GLOBAL_ORDER=0 FAH_BWD_SECTION_MIB=32"
       "FAH_BWD_GQA_GLOBAL_ORDER=0 FAH_BWD_SECTION_MIB=64" "FAH_BWD_GQA_GLOBAL_ORDER=0 FAH_BWD_SECTION_MIB=128")
for r in 1 2; do
  order=("${CASES[@]}")
  if (( r == 2 )); then mapfile -t order < <(printf '%s\n' "${CASES[@]}" | tac); fi
  for c in "${order[@]}"; do
    echo "== round $r: $c"
    env $c GQA_CAUSAL=yes timeout 60 python3 scripts/gqa_bwd_points.py 1024,2048,4096,16384 16,4 128
    env $c GQA_CAUSAL=yes timeout 60 python3 scripts/gqa_bwd_points.py 1024,2048,4096,16384 16,4,2 64
  done
done 2>&1 | tee "$OUT/gqa_sections.txt"
