#!/usr/bin/env bash
# Session 28, the final check in one call, on a build of the submitted tree made on the CPU machine with the device's
# torch (2.11.0+cu130, py_limited_api) and carried in .prebuilt/pack/p.tar.xz as .prebuilt/FIN28 (the .so and its
# build log with the ptxas report): scripts/gpu_check.sh with FAH_PREBUILT=1 (the SASS/HGMMA check of the carried .so,
# every GPU test file, then the full grid: ours, cuDNN, FA2, the feature points with their dense references timed
# beside them); then, with what time is left, a three-round A/B of the run-time Q buffer index (BQ = the session's
# starting kernels, RQA = this tree's head_dim 64/128 forward kernels, the same SASS) where call 3 read it lowest.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
rm -rf .fah_build; rm -f flash_attn_hopper/_C*.so
cp -f .prebuilt/FIN28/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
FINAL=$OUT
export OUT=/tmp/gc; mkdir -p $OUT
FAH_PREBUILT=1 FAH_BUILD_LOG=$PWD/.prebuilt/FIN28/build.log PYTEST_ARGS="--timeout 150 --timeout-method thread" \
  timeout ${CHECK_TIMEOUT:-440} bash scripts/gpu_check.sh > /tmp/gpu_check.out 2>&1
echo "gpu_check rc $?"
tail -n 60 /tmp/gpu_check.out | grep -v "^| dense | \(64\|256\)"
for f in summary.txt pytest.log kernels.txt bench_attention.json bench_extra.tar.gz; do cp -f $OUT/$f $FINAL/ 2>/dev/null; done
export OUT=$FINAL
CASES="BQ;RQA" DIRECTION=fwd ROUNDS=${ROUNDS:-3} TAG=rq3 BACKENDS=ours \
  BENCH="--head-dims 128,64 --causal no --features dense --seqlens 4096,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-110} bash scripts/device_env_ab.sh
cp -f .prebuilt/FIN28/_C.abi3.so flash_attn_hopper/_C.abi3.so
