#!/usr/bin/env bash
# Session 41, one call on a prebuilt head_dim 64/128 bf16 build carried in .prebuilt/pack (gqa = the GQA backward
# rule by mask, config.hpp bwd_heads_per_cta):
#   tests: TESTS (default: the backward's GQA tests and the forced-mode file) on that build;
#   points: scripts/gqa_bwd_points.py at 16/2 and 16/1 (256 and 128 CTAs: below the old rule's 2 x SMs), both
#           masks, head_dim 64 and 128, with the launcher's pick and each mode forced, ROUNDS rounds, the modes'
#           order reversed every other round.
# Usage: STEPS="tests points" bash scripts/history/device_session41.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for n in ${PACKS:-gqa}; do
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" .prebuilt/pack/$n.tar.xz || exit 1
done
cp -f .prebuilt/${BUILD:-GQA}/_C.abi3.so flash_attn_hopper/_C.abi3.so
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader
for step in ${STEPS:-tests points}; do
  case $step in
    tests)
      timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider --timeout 200 --timeout-method thread \
        ${TESTS:-tests/test_bwd_gpu.py -k gqa tests/test_bwd_gqa_group_gpu.py} > $OUT/pytest_s41.log 2>&1
      echo "pytest rc $?"; tail -n 15 $OUT/pytest_s41.log ;;
    points)
      for r in $(seq 1 ${ROUNDS:-2}); do
        modes="rule 0 1"; [[ $((r % 2)) == 0 ]] && modes="1 0 rule"
        for mode in $modes; do
          for causal in no yes; do
            for hd in ${POINT_HD:-64 128}; do
              env $([[ $mode != rule ]] && echo FAH_BWD_GQA_GROUP_CTA=$mode) GQA_CAUSAL=$causal timeout 120 \
                python3 scripts/gqa_bwd_points.py ${POINT_SEQLENS:-2048,4096,8192} 2,1 $hd 2>&1 \
                | sed "s/^/r$r $mode /" | tee -a $OUT/points.txt
            done
          done
        done
      done ;;
  esac
done
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader
