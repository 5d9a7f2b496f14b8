#!/usr/bin/env bash
# One call (~8 min): the GPU check from a clean build (scripts/history/device_run4.sh: SASS, every GPU test, the benchmark
# grid with the feature points), then examples/train_lm.py with --repeats (issue 4), results in $OUT.
set -u
TRAIN=1 TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-170} TRAIN_ARGS="--repeats ${REPEATS:-3} --steps ${STEPS:-200} --log-every 100" \
  CHECK_TIMEOUT=${CHECK_TIMEOUT:-430} bash scripts/history/device_run4.sh 2>&1 | grep -v '^| \(varlen\|window\|gqa\|deterministic\) ' | tail -n 50
