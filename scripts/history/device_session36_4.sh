#!/usr/bin/env bash
# Session 36, call 4, on build F: causal GQA backward with the group CTA forced and one section for all pairs
# (FAH_BWD_SECTION_MIB=1000000: key block n of every (K/V head, batch) pair before key block n + 1, i.e. longest
# first over the whole grid) against the default (group CTA in 24 MiB sections where the grid has >= 2 x SMs CTAs,
# else one CTA per query head with fp32 sums). 16 query heads on 4, 2, 1 K/V heads, 2048-8192, head_dim 64/128/256.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD GQA_CAUSAL=yes
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/f.tar.xz').extractall('.prebuilt')"
cp -f .prebuilt/F/_C.abi3.so flash_attn_hopper/_C.abi3.so
G="FAH_BWD_GQA_GROUP_CTA=1 FAH_BWD_SECTION_MIB=1000000"
for r in 1 2; do
  order=("X=1" "$G"); if (( r == 2 )); then order=("$G" "X=1"); fi
  for e in "${order[@]}"; do
    for hd in ${HDS:-128 64 256}; do
      echo "== round $r: $e hd $hd"
      env $e timeout 60 python3 scripts/gqa_bwd_points.py ${GQA_SEQ:-2048,4096,8192} ${GQA_HK:-4,2,1} $hd 2>&1 | tee -a $OUT/gqa4_$(echo $e | cut -c1-24 | tr "= " "__").txt
    done
  done
done
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv > $OUT/smi.txt
