#!/usr/bin/env bash
# Session 36, call 3, on build F: the GQA group CTA forced (FAH_BWD_GQA_GROUP_CTA=1) where the launcher's rule (>= 2 x
# SMs CTAs) picks one CTA per query head with fp32 sums: 16 query heads on 2 and 1 K/V heads (256 and 128 group CTAs
# at 16k tokens), both masks, 2048-8192, head_dim 64/128/256; against the default, two rounds in alternating order.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/f.tar.xz').extractall('.prebuilt')"
cp -f .prebuilt/F/_C.abi3.so flash_attn_hopper/_C.abi3.so
for r in 1 2; do
  order=("X=1" "FAH_BWD_GQA_GROUP_CTA=1"); if (( r == 2 )); then order=("FAH_BWD_GQA_GROUP_CTA=1" "X=1"); fi
  for e in "${order[@]}"; do
    for hd in ${HDS:-128 64 256}; do
      echo "== round $r: $e hd $hd"
      env $e timeout 60 python3 scripts/gqa_bwd_points.py ${GQA_SEQ:-2048,4096,8192} ${GQA_HK:-2,1} $hd 2>&1 | tee -a $OUT/gqa3_$(echo $e | tr "=" "_").txt
    done
  done
done
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv > $OUT/smi.txt
