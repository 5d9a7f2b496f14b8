#!/usr/bin/env bash
# Session 25, last call: every GPU test file on a full build of the submitted tree made on the CPU machine from a
# clean clone (torch 2.11.0's venv, all head dims and dtypes: .prebuilt/FINAL/_C.abi3.so in .prebuilt/pack/p.tar.xz),
# through the GPU check's SASS and test stages (FAH_PREBUILT=1, no benchmark), with a per-test hang guard.
# PYTEST_EXTRA: more pytest arguments (session 25 deselected the head_dim 64 forced-tile and no-ping-pong runs of
# tests/test_fwd_tiles_gpu.py, which call 2 had run on the same head_dim 64 code, to fit the device time left).
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
cp -f .prebuilt/FINAL/_C.abi3.so flash_attn_hopper/_C.abi3.so
FAH_PREBUILT=1 FAH_SKIP_BENCH=1 PYTEST_ARGS="--timeout 150 --timeout-method thread ${PYTEST_EXTRA:-}" \
  timeout ${CHECK_TIMEOUT:-480} bash scripts/gpu_check.sh > /tmp/gpu_check.out 2>&1
echo "gpu_check rc $?"
tail -n 40 /tmp/gpu_check.out
cp -f .fah_build/gpu_check/{summary.txt,pytest.log,kernels.txt} $OUT/ 2>/dev/null
gzip -f $OUT/pytest.log 2>/dev/null
ls $OUT
