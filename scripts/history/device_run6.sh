#!/usr/bin/env bash
# The whole session check in one device call (~7 min): scripts/history/device_run4.sh (clean build, SASS, all GPU tests,
# benchmark with the feature points), then scripts/history/device_run5.sh on that build (host cost, train_lm --repeats 4,
# per-kernel step profile). At most 8 files in $OUT.
set -u
CHECK_TIMEOUT=${CHECK_TIMEOUT:-420} bash scripts/history/device_run4.sh 2>&1 | grep -v "^| \(varlen\|window\|softcap\|gqa\|deterministic\) " | tail -n 40
PREBUILT=1 REPEATS=${REPEATS:-4} TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-200} bash scripts/history/device_run5.sh 2>&1 | tail -n 40
