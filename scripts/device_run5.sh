#!/usr/bin/env bash
# One device call for the training-loop issue (issue 4): build + SASS + all GPU tests through the GPU check (no
# benchmark), then the host cost per call (scripts/host_overhead.py), examples/train_lm.py with each backend first
# (two processes), and the per-step profile (scripts/profile_train.py). Results within 8 files in $OUT.
set -u
FINAL=$OUT
export OUT=/tmp/gc
mkdir -p $OUT
rm -f flash_attn_hopper/_C*.so; rm -rf build .fah_build
FAH_SKIP_BENCH=${FAH_SKIP_BENCH:-1} PYTEST_ARGS="--timeout 150 --timeout-method thread" timeout ${CHECK_TIMEOUT:-300} \
  bash scripts/gpu_check.sh > /tmp/gpu_check.out 2>&1
echo "gpu_check rc $?"
tail -n 12 /tmp/gpu_check.out
cp -f $OUT/summary.txt $OUT/pytest.log $FINAL/ 2>/dev/null
{
  PYTHONPATH=$PWD timeout 60 python3 scripts/host_overhead.py --iters 500
  for order in flash_attn_hopper,sdpa sdpa,flash_attn_hopper; do
    echo "== train_lm --backends $order"
    PYTHONPATH=$PWD timeout ${TRAIN_TIMEOUT:-150} python3 examples/train_lm.py --backends $order \
      --json $FINAL/train_lm_${order%%,*}_first.json 2>&1 | grep -v "^\[.*step " | tail -n 14
  done
  PYTHONPATH=$PWD timeout 90 python3 scripts/profile_train.py --steps 5 2>&1 | grep -v Warning | head -n 40
} 2>&1 | tee $FINAL/issue4.txt
ls $FINAL
