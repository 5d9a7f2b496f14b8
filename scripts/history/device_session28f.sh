#!/usr/bin/env bash
# Session 28: the GPU check of the submitted tree from a clean build on the device (scripts/history/device_run4.sh: build,
# SASS and every GPU test file but test_varlen_gpu.py, which device_session28g.sh runs on the same warm machine).
set -u
export PYTHONUNBUFFERED=1
FAH_SKIP_BENCH=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-500} PYTEST_EXTRA="--ignore=tests/test_varlen_gpu.py" \
  bash scripts/history/device_run4.sh
