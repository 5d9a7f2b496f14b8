#!/usr/bin/env bash
# The session's closing check in one device call (~8.5 min): scripts/history/device_run4.sh (clean build, SASS, all GPU tests,
# benchmark grid with the feature points), then on that build examples/train_lm.py --repeats ${REPEATS:-4} and the
# per-kernel step profile (issue 4). At most 8 files in $OUT.
set -u
CHECK_TIMEOUT=${CHECK_TIMEOUT:-400} bash scripts/history/device_run4.sh 2>&1 | grep -v "^| \(varlen\|window\|softcap\|gqa\|deterministic\) " | tail -n 40
ls flash_attn_hopper/_C*.so || exit 1
{
  echo "== train_lm --repeats ${REPEATS:-4}"
  PYTHONPATH=$PWD timeout ${TRAIN_TIMEOUT:-190} python3 examples/train_lm.py --repeats ${REPEATS:-4} \
    --json $OUT/train_lm.json 2>&1 | grep -v "^\[.*step " | tail -n 8
  PYTHONPATH=$PWD timeout 60 python3 scripts/profile_train.py --steps 5 2>&1 | grep -v Warning | tail -n 22
} 2>&1 | tee $OUT/issue4.txt
