#!/usr/bin/env bash
# Session 36, call 2, on build F (session 35's full build = the submitted kernels, carried in .prebuilt/pack):
#  1. GQA backward at head_dim 128 (scripts/gqa_bwd_points.py: 16 query heads on 16/8/4/2 K/V heads, 2048-8192,
#     both masks) under the launcher's default, one CTA per query head (FAH_BWD_GQA_GROUP_CTA=0) and no sections
#     (FAH_BWD_SECTION_MIB=0), rounds in alternating order;
#  2. the softcap forward with the polynomial tanh alone (build PO, session 34's timing-only patch: wrong above
#     |x| = 0.5, so timing only) beside F, scripts/softcap_paths_time.py at scale 1 (every |x| below 0.5).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for f in .prebuilt/pack/f.tar.xz .prebuilt/pack/po.tar.xz; do python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" "$f"; done
cp -f .prebuilt/F/_C.abi3.so flash_attn_hopper/_C.abi3.so
C=("X=1" "FAH_BWD_GQA_GROUP_CTA=0" "FAH_BWD_SECTION_MIB=0")
for r in 1 2; do
  order=("${C[@]}"); if (( r == 2 )); then order=("${C[2]}" "${C[1]}" "${C[0]}"); fi
  for e in "${order[@]}"; do
    echo "== gqa round $r: $e"
    env $e timeout 100 python3 scripts/gqa_bwd_points.py ${GQA_SEQ:-2048,4096,8192} ${GQA_HK:-16,8,4,2} 2>&1 | tee -a $OUT/gqa_$(echo $e | tr "=" "_").txt
  done
done
for r in 1 2; do
  order=(F PO); if (( r == 2 )); then order=(PO F); fi
  for b in "${order[@]}"; do
    cp -f .prebuilt/$b/_C.abi3.so flash_attn_hopper/_C.abi3.so
    echo "== softcap round $r: $b"
    timeout 90 python3 scripts/softcap_paths_time.py 128 1024,4096,16384 30 1 2>&1 | tee -a $OUT/softcap_$b.txt
  done
done
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv > $OUT/smi.txt
