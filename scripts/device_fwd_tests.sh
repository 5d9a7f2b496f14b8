#!/usr/bin/env bash
# usage: [TEST_TIMEOUT=s] bash scripts/device_fwd_tests.sh BUILD  (kept for the session scripts that call it)
exec bash scripts/device_build_tests.sh fwd "$@"
