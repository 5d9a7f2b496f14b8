#!/usr/bin/env bash
# Prepared in session 32 for the next one (not run yet): every GPU test on H33 (session 32's head with
# bwd_sectioned_order_UNTESTED.patch applied, full build made on the CPU machine with the device's torch, carried in
# .prebuilt/pack/p.tar.xz), for the commit that lands the patch if scripts/device_session33a.sh keeps it. No benchmark:
# the grid goes in its own call (scripts/device_session33c.sh).
set -u
export PYTHONUNBUFFERED=1
FAH_SKIP_BENCH=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-480} bash scripts/device_prebuilt_check.sh H33
