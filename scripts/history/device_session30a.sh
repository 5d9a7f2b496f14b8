#!/usr/bin/env bash
# Session 30 call 1: the GPU check of the submitted tree (3182d08) from a clean build on the device: build (every
# head dim and dtype), SASS / HGMMA check, every GPU test file including test_varlen_gpu.py; no grid.
set -u
export PYTHONUNBUFFERED=1
FAH_SKIP_BENCH=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-575} bash scripts/history/device_run4.sh
