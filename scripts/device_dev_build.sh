#!/usr/bin/env bash
# Development build on the device from a clean tree through scripts/gpu_check.sh (build and SASS check only, one head
# dim and dtype by default: FAH_HDIMS=64 FAH_DTYPES=bf16), printing its build and sass lines. Sourced by the
# one-call device scripts; the caller's $OUT is left alone (gpu_check writes to /tmp/gcout).
rm -rf build .fah_build flash_attn_hopper/_C*.so
OUT=/tmp/gcout FAH_HDIMS=${FAH_HDIMS:-64} FAH_DTYPES=${FAH_DTYPES:-bf16} FAH_SKIP_TESTS=1 FAH_SKIP_BENCH=1 \
  bash scripts/gpu_check.sh > /tmp/gc.log 2>&1
grep -E "^(build|sass) " /tmp/gc.log
