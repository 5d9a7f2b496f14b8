#!/usr/bin/env bash
# Session 29 call 3 (builds made on the CPU machine, carried in .prebuilt/pack/p.tar.xz): FIN29 = the submitted tree
# of call 1 (a2f5926's kernels), CT = FIN29 + head_dim 64's persistent 128-row tiles issuing each tile's first QKᵀ
# during the previous tile's drain and epilogue (FwdKernelTraits::kCrossTile). First a three-round A/B of the
# forward, head_dim 64, both masks, 512-4096 (128-row tiles at causal 512-4096 and non-causal 512/1024; the 192-row
# points, whose kernel is the same in both builds, are the control); then scripts/gpu_check.sh's tests on CT.
# (The gpu_check block is scripts/device_prebuilt_check.sh since session 29's review: the same commands.)
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
rm -rf .fah_build
CASES="FIN29;CT" DIRECTION=fwd ROUNDS=${ROUNDS:-3} TAG=ct BACKENDS=ours \
  BENCH="--head-dims 64 --causal both --features dense --seqlens 512,1024,2048,4096 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-150} bash scripts/device_env_ab.sh
FAH_SKIP_BENCH=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-410} bash scripts/device_prebuilt_check.sh CT
