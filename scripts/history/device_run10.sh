#!/usr/bin/env bash
# Session 6's first device call (~8 min): scripts/history/device_run4.sh (clean build, SASS, all GPU tests, benchmark grid),
# then scripts/train_clocks.sh on that build (issue 4: tokens/s with SM clock and power per backend, ROUNDS rounds in
# alternating order); the clock logs come back as one tarball.
set -u
CHECK_TIMEOUT=${CHECK_TIMEOUT:-450} bash scripts/history/device_run4.sh 2>&1 | grep -v "^| \(varlen\|window\|softcap\|gqa\|deterministic\) " | tail -n 40
ls flash_attn_hopper/_C*.so || exit 1
FINAL=$OUT
OUT=/tmp/tc ROUNDS=${ROUNDS:-2} PYTHONPATH=$PWD timeout ${CLOCKS_TIMEOUT:-130} bash scripts/train_clocks.sh 2>&1 | tee $FINAL/train_clocks.txt
tar czf $FINAL/train_clocks.tar.gz -C /tmp/tc train_clocks 2>/dev/null
