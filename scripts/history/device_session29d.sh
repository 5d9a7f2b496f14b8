#!/usr/bin/env bash
# Not run: the device refused two starts and then had too little budget left (NOTES, session 29).
# Session 29 call 4: the GPU check of the submitted tree on a build made on the CPU machine (.prebuilt/CT2 in
# .prebuilt/pack/p.tar.xz: call 3's CT with the review's changes: tSrS_first cleared where no WGMMA writes it, 16
# SASS instructions fewer per kernel outside the key-block loop, the loop unchanged; the new varlen test reworked):
# scripts/gpu_check.sh with FAH_PREBUILT=1 and FAH_SKIP_BENCH=1 (SASS/HGMMA check and every GPU test file).
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
rm -rf .fah_build
FAH_SKIP_BENCH=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-480} bash scripts/device_prebuilt_check.sh CT2
