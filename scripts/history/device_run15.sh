#!/usr/bin/env bash
# Session 7's first call: the GPU check of the submitted tree from a clean build (scripts/history/device_run4.sh), then the
# per-call host cost with its profile (scripts/host_overhead.py --profile, issue 4) on the .so that check built.
set -u
CHECK_TIMEOUT=${CHECK_TIMEOUT:-440} bash scripts/history/device_run4.sh 2>&1 | grep -v '^| \(varlen\|window\|gqa\|deterministic\) ' | tail -n 45
readelf -d flash_attn_hopper/_C.abi3.so | grep NEEDED
PYTHONPATH=$PWD timeout 90 python3 scripts/host_overhead.py --profile > $OUT/host_overhead.log 2>&1
echo "host_overhead rc $?"; head -n 8 $OUT/host_overhead.log
