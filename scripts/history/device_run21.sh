#!/usr/bin/env bash
# issue 4's run: examples/train_lm.py, 300 steps per backend, --repeats (default 3), on the extension the previous call
# built (kept on a warm machine), else a head_dim 64 bf16 development build made here. Results in $OUT.
set -u
if ! ls flash_attn_hopper/_C*.so > /dev/null 2>&1; then
  echo "no build in the tree: development build"
  source scripts/device_dev_build.sh
  cp -f .fah_build/*/flash_attn_hopper/_C*.so flash_attn_hopper/ 2>/dev/null
fi
ls flash_attn_hopper/_C*.so
PYTHONPATH=$PWD timeout ${TRAIN_TIMEOUT:-480} python3 examples/train_lm.py --repeats ${REPEATS:-3} --steps ${STEPS:-300} \
  --log-every 100 --json $OUT/train_lm.json > $OUT/train_lm.log 2>&1
echo "train rc $?"
tail -n 8 $OUT/train_lm.log
