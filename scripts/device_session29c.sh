#!/usr/bin/env bash
# Session 29 call 3 (builds made on the CPU machine, carried in .prebuilt/pack/p.tar.xz): FIN29 = the submitted tree
# of call 1 (a2f5926's kernels), CT = FIN29 + head_dim 64's persistent 128-row tiles issuing each tile's first QKᵀ
# during the previous tile's drain and epilogue (FwdKernelTraits::kCrossTile). First a three-round A/B of the
# forward, head_dim 64, both masks, 512-4096 (128-row tiles at causal 512-4096 and non-causal 512/1024; the 192-row
# points, whose kernel is the same in both builds, are the control); then scripts/gpu_check.sh's tests on CT.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
rm -rf .fah_build; rm -f flash_attn_hopper/_C*.so
CASES="FIN29;CT" DIRECTION=fwd ROUNDS=${ROUNDS:-3} TAG=ct BACKENDS=ours \
  BENCH="--head-dims 64 --causal both --features dense --seqlens 512,1024,2048,4096 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-150} bash scripts/device_env_ab.sh
cp -f .prebuilt/CT/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
FINAL=$OUT
export OUT=/tmp/gc; mkdir -p $OUT
FAH_PREBUILT=1 FAH_SKIP_BENCH=1 FAH_BUILD_LOG=$PWD/.prebuilt/CT/build.log \
  PYTEST_ARGS="--timeout 150 --timeout-method thread" timeout ${CHECK_TIMEOUT:-410} bash scripts/gpu_check.sh \
  > /tmp/gpu_check.out 2>&1
echo "gpu_check rc $?"
grep -E "^tests|passed|failed|FAILED|Error" /tmp/gpu_check.out | tail -n 25
for f in summary.txt pytest.log kernels.txt; do cp -f $OUT/$f $FINAL/ 2>/dev/null; done
