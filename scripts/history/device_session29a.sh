#!/usr/bin/env bash
# Session 29 call 1: the GPU check of the submitted tree on a build made on the CPU machine with the device's torch
# (2.11.0+cu130, py_limited_api), carried in .prebuilt/pack/p.tar.xz as .prebuilt/FIN29 (the .so and its build log
# with the ptxas report): scripts/gpu_check.sh with FAH_PREBUILT=1 and FAH_SKIP_BENCH=1 (the SASS/HGMMA check of the
# carried .so and every GPU test file). The grid runs in call 2 (device_session29b.sh) on the same warm machine.
# (The gpu_check block is scripts/device_prebuilt_check.sh since session 29's review: the same commands.)
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
rm -rf .fah_build
FAH_SKIP_BENCH=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-540} bash scripts/device_prebuilt_check.sh FIN29
