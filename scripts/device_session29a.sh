#!/usr/bin/env bash
# Session 29 call 1: the GPU check of the submitted tree on a build made on the CPU machine with the device's torch
# (2.11.0+cu130, py_limited_api), carried in .prebuilt/pack/p.tar.xz as .prebuilt/FIN29 (the .so and its build log
# with the ptxas report): scripts/gpu_check.sh with FAH_PREBUILT=1 and FAH_SKIP_BENCH=1 (the SASS/HGMMA check of the
# carried .so and every GPU test file). The grid runs in call 2 (device_session29b.sh) on the same warm machine.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
rm -rf .fah_build; rm -f flash_attn_hopper/_C*.so
cp -f .prebuilt/FIN29/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
FINAL=$OUT
export OUT=/tmp/gc; mkdir -p $OUT
FAH_PREBUILT=1 FAH_SKIP_BENCH=1 FAH_BUILD_LOG=$PWD/.prebuilt/FIN29/build.log \
  PYTEST_ARGS="--timeout 150 --timeout-method thread" timeout ${CHECK_TIMEOUT:-540} bash scripts/gpu_check.sh \
  > /tmp/gpu_check.out 2>&1
echo "gpu_check rc $?"
tail -n 40 /tmp/gpu_check.out
for f in summary.txt pytest.log kernels.txt; do cp -f $OUT/$f $FINAL/ 2>/dev/null; done
