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
rm -rf .fah_build; rm -f flash_attn_hopper/_C*.so
cp -f .prebuilt/CT2/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
FINAL=$OUT
export OUT=/tmp/gc; mkdir -p $OUT
FAH_PREBUILT=1 FAH_SKIP_BENCH=1 FAH_BUILD_LOG=$PWD/.prebuilt/CT2/build.log \
  PYTEST_ARGS="--timeout 150 --timeout-method thread" timeout ${CHECK_TIMEOUT:-480} bash scripts/gpu_check.sh \
  > /tmp/gpu_check.out 2>&1
echo "gpu_check rc $?"
grep -E "^tests|passed|failed|FAILED|Error|HGMMA check" /tmp/gpu_check.out | tail -n 25
for f in summary.txt pytest.log kernels.txt; do cp -f $OUT/$f $FINAL/ 2>/dev/null; done
