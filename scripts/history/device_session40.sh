#!/usr/bin/env bash
# Session 40, one call on prebuilt head_dim 64/128 bf16 builds carried in .prebuilt/pack (h = HEAD, v1, e1r):
#   1. the forward A/B of HEAD, V1 (quad maximum before the scale) and E1R (E1's arithmetic on HEAD), dense,
#      head_dim 64/128, both masks, 1024/4096/16384, ROUNDS rounds with the order reversed every other round;
#   2. TESTS (default: the sixth-round file and test_transformers_gpu.py) on HEAD's Python with HEAD's build;
#   3. scripts/fp16_beside.py --control (bf16 beside a bf16 copy: the noise floor of the fp16 ratios);
#   4. order: the benchmark's dense points with ours timed first and last, with and without --settle (is the first
#      backend timed at a point favoured by the lighter work before it?), ORDER_ROUNDS rounds.
# Usage: STEPS="ab tests control" bash scripts/history/device_session40.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for n in ${PACKS:-h v1 e1r}; do
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" .prebuilt/pack/$n.tar.xz || exit 1
done
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader
for step in ${STEPS:-ab tests control}; do
  case $step in
    ab)
      CASES=${CASES:-"H;V1;E1R"} DIRECTION=fwd ROUNDS=${ROUNDS:-3} TAG=s40 BACKENDS=ours \
        BENCH="--head-dims ${AB_HD:-64,128} --causal both --features dense --seqlens 1024,4096,16384 --no-check --no-adjacent" \
        timeout ${AB_TIMEOUT:-330} bash scripts/device_env_ab.sh
      IFS=';' read -ra C <<< "${CASES:-H;V1;E1R}"
      for c in "${C[@]:1}"; do  # each case against the first
        python3 scripts/ab_compare.py /tmp/env_ab_s40 ${C[0]} $c > $OUT/ab_${c,,}.txt 2>&1; cat $OUT/ab_${c,,}.txt
      done ;;
    tests)
      cp -f .prebuilt/${TEST_BUILD:-H}/_C.abi3.so flash_attn_hopper/_C.abi3.so
      timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider --timeout 150 --timeout-method thread \
        ${TESTS:-tests/test_bug_reports_sixth_gpu.py tests/test_transformers_gpu.py} > $OUT/pytest_s40.log 2>&1
      echo "pytest rc $?"; tail -n 15 $OUT/pytest_s40.log ;;
    control)
      cp -f .prebuilt/${CONTROL_BUILD:-H}/_C.abi3.so flash_attn_hopper/_C.abi3.so
      timeout ${CONTROL_TIMEOUT:-150} python3 scripts/fp16_beside.py --control --head-dims ${CONTROL_HD:-64,128} \
        --seqlens 4096,16384 --rounds ${CONTROL_ROUNDS:-4} --json $OUT/control.json 2>&1 | tee $OUT/control.txt ;;
    order)
      cp -f .prebuilt/${ORDER_BUILD:-E1R}/_C.abi3.so flash_attn_hopper/_C.abi3.so
      mkdir -p $OUT/order
      for r in $(seq 1 ${ORDER_ROUNDS:-2}); do
        for settle in "" "--settle"; do
          for backends in ours,cudnn cudnn,ours; do
            echo "== round $r: $backends $settle"
            timeout 120 python3 -m flash_attn_hopper.benchmark --head-dims ${ORDER_HD:-64,128} --causal both \
              --features dense --seqlens 4096,16384 --no-check --no-adjacent --no-bar --backends $backends $settle \
              --json $OUT/order/${backends/,/_}${settle/--/_}_r$r.json 2>&1 | grep "^| " | cut -d'|' -f2-8
          done
        done
      done ;;
  esac
done
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader
