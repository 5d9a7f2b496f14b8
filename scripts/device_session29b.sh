#!/usr/bin/env bash
# Session 29 call 2, on the machine of call 1 (the carried .so is already in place; if the machine was given back,
# it is unpacked again): the full grid (scripts/gpu_check.sh's bench stage: ours, cuDNN, FA2, the feature points with
# their dense references timed beside them) with its summary and plots; then Nsight Compute of the head_dim 64
# causal forward at 1024 (issue 6's 0.97x cuDNN point) and 16384, for the instruction-fetch stalls (No Instruction)
# that session 28's lesson points at.
set -u
export PYTHONUNBUFFERED=1
if [[ ! -f flash_attn_hopper/_C.abi3.so ]]; then
  python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
  cp -f .prebuilt/FIN29/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
fi
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
FINAL=$OUT
export OUT=/tmp/gcb; mkdir -p $OUT
FAH_PREBUILT=1 FAH_SKIP_TESTS=1 FAH_BUILD_LOG=$PWD/.prebuilt/FIN29/build.log timeout ${CHECK_TIMEOUT:-300} \
  bash scripts/gpu_check.sh > /tmp/gpu_check_bench.out 2>&1
echo "gpu_check (bench) rc $?"
tail -n 20 /tmp/gpu_check_bench.out
for f in summary.txt bench_attention.json bench_extra.tar.gz; do cp -f $OUT/$f $FINAL/ 2>/dev/null; done
export OUT=$FINAL
CASES="64 1024 dense causal;64 16384 dense causal" TAG=hd64causal NCU_TIMEOUT=100 timeout 240 bash scripts/ncu_fwd.sh
