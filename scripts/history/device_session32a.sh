#!/usr/bin/env bash
# Prepared in session 31 for the next one (not run yet): every GPU test file on the submitted kernels (session 31's
# one-sided mask and clear placement), built from 3b9a1f1 (csrc differs from the head's only in comments) on the CPU
# machine with the device's torch and carried in .prebuilt/pack/p.tar.xz as .prebuilt/H31 (cd .prebuilt && tar cJf
# pack/p.tar.xz H31), so the call spends no time on the build (session 31's clean device build took 158 s and cut the
# tests at 1687 of 2163). No benchmark.
set -u
export PYTHONUNBUFFERED=1
FAH_SKIP_BENCH=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-560} bash scripts/device_prebuilt_check.sh H31
