#!/usr/bin/env bash
# Session 36: the GPU check of the tree as sent, in two calls on one warm machine.
#   PART=a: clean build on the device (every head dim and dtype; the CUTLASS wheel carried in .whl), SASS / HGMMA
#           check, the GPU test files of group A (every file not in group B); the .so and its build log go to
#           $OUT/verify_so.tar.xz so that part b can run on a fresh machine too (carry it as .prebuilt/pack).
#   PART=a PREBUILT=NAME: no device build; .prebuilt/pack/name.tar.xz's build (PACK=file stem to override, e.g.
#           PREBUILT=VERIFY PACK=verify_so: a carried device build; made on the CPU machine with the device's torch,
#           or an earlier device build) runs group A's files, then the forward A/B of F against it (AB=1, the default) and
#           the extras below (EXTRA=1).
#   PART=b: the same .so (left in the tree, or unpacked from .prebuilt/pack/verify_so.tar.xz or PREBUILT's pack),
#           group B's test files
#           and the benchmark grid with the feature points; then extras (EXTRA=1): the backward's pre/postprocess
#           share and the forward's fp16 and bf16 dense points from 4096 (issue 6: fp16 within 3 %).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
B="tests/test_bwd_gpu.py tests/test_features_gpu.py tests/test_head_dim_v_gpu.py tests/test_varlen_gpu.py
   tests/test_deterministic_gpu.py tests/test_sections_gpu.py tests/test_bwd_gqa_group_gpu.py tests/test_sanitizer_gpu.py"
ign() { for f in $*; do printf -- "--ignore=%s " "$f"; done; }
unpack() {  # .prebuilt/pack/$1.tar.xz holding .prebuilt/NAME/{_C.abi3.so,build.log}: into the tree
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" .prebuilt/pack/$1.tar.xz || exit 1
}
extras() {  # the backward's pre/postprocess share; the forward's fp16 and bf16 dense points from 4096
  timeout 90 python3 scripts/bwd_breakdown.py 64,128,256 4096,16384 > $OUT/bwd_breakdown.txt 2>&1; echo "breakdown rc $?"; tail -n 15 $OUT/bwd_breakdown.txt
  timeout ${FP16_TIMEOUT:-100} python3 -m flash_attn_hopper.benchmark --dtype fp16 --features dense --seqlens 4096,16384 \
    --backends ours --direction fwd --no-bar --json $OUT/fp16.json > $OUT/fp16.log 2>&1
  timeout ${FP16_TIMEOUT:-100} python3 -m flash_attn_hopper.benchmark --dtype bf16 --features dense --seqlens 4096,16384 \
    --backends ours --direction fwd --no-bar --json $OUT/bf16.json > $OUT/bf16.log 2>&1
  echo "fp16/bf16 rc $?"
}
if [[ ${PART:?PART=a or b} == a && -n ${PREBUILT:-} ]]; then
  # PREBUILT=NAME: the build made on the CPU machine with the device's torch, no device build; then, with AB=1, the
  # forward A/B of F against it (dense, every head dim, both masks, 1024/4096/16384, 2 rounds).
  unpack ${PACK:-$(echo $PREBUILT | tr A-Z a-z)}; if [[ ${AB:-1} == 1 ]]; then unpack f; fi
  rm -f flash_attn_hopper/_C*.so; cp .prebuilt/$PREBUILT/_C.abi3.so flash_attn_hopper/_C.abi3.so
  FINAL=$OUT; export OUT=/tmp/gca; mkdir -p $OUT
  FAH_PREBUILT=1 FAH_BUILD_LOG=$PWD/.prebuilt/$PREBUILT/build.log PYTEST_ARGS="--timeout 150 --timeout-method thread $(ign $B)" \
    FAH_SKIP_BENCH=1 timeout ${CHECK_TIMEOUT:-330} bash scripts/gpu_check.sh > /tmp/gpu_check_a.out 2>&1
  echo "gpu_check rc $?"
  grep -E "^(tests|sass|bench|build|cutlass) |passed|failed|FAILED|HGMMA check" /tmp/gpu_check_a.out | tail -n 20
  for f in summary.txt pytest.log kernels.txt; do cp -f $OUT/$f $FINAL/ 2>/dev/null; done
  export OUT=$FINAL
  if [[ ${AB:-1} == 1 ]]; then
    CASES="F;$PREBUILT" DIRECTION=fwd ROUNDS=2 TAG=fwd BACKENDS=ours \
      BENCH="--head-dims 64,128,256 --causal both --features dense --seqlens 1024,4096,16384 --no-check --no-adjacent" \
      timeout ${AB_TIMEOUT:-160} bash scripts/device_env_ab.sh
    cp -f .prebuilt/$PREBUILT/_C.abi3.so flash_attn_hopper/_C.abi3.so  # part b runs this build
  fi
  if [[ ${EXTRA:-0} == 1 ]]; then extras; fi
elif [[ $PART == a ]]; then
  PYTEST_EXTRA="$(ign $B)" FAH_SKIP_BENCH=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-500} bash scripts/history/device_run4.sh
  python3 - <<'PY'
import os, tarfile
with tarfile.open(os.environ["OUT"] + "/verify_so.tar.xz", "w:xz", preset=1) as t:
    t.add("flash_attn_hopper/_C.abi3.so", "VERIFY/_C.abi3.so")
    t.add(".fah_build/gpu_check/build.log", "VERIFY/build.log")
PY
  ls -la $OUT
else
  if [[ ! -f flash_attn_hopper/_C.abi3.so ]]; then  # a fresh machine: the carried build (PREBUILT, else part a's)
    name=${PREBUILT:-VERIFY}; unpack ${PACK:-$([[ -n ${PREBUILT:-} ]] && echo $PREBUILT | tr A-Z a-z || echo verify_so)}
    cp .prebuilt/$name/_C.abi3.so flash_attn_hopper/_C.abi3.so; mkdir -p .fah_build/gpu_check
    cp .prebuilt/$name/build.log .fah_build/gpu_check/build.log
    echo "unpacked the carried .so"
  fi
  if [[ -n ${PREBUILT:-} ]]; then export FAH_BUILD_LOG=$PWD/.prebuilt/$PREBUILT/build.log; fi
  FINAL=$OUT; export OUT=/tmp/gcb; mkdir -p $OUT
  others=$(ls tests/test_*.py | grep -v -F "$(echo $B | tr ' ' '\n')")
  FAH_PREBUILT=1 PYTEST_ARGS="--timeout 150 --timeout-method thread $(ign $others)" \
    timeout ${CHECK_TIMEOUT:-420} bash scripts/gpu_check.sh > /tmp/gpu_check_b.out 2>&1
  echo "gpu_check rc $?"
  grep -E "^(tests|sass|bench|build|cutlass) |passed|failed|FAILED|HGMMA check" /tmp/gpu_check_b.out | tail -n 20
  for f in summary.txt pytest.log bench_attention.json bench_extra.tar.gz; do cp -f $OUT/$f $FINAL/ 2>/dev/null; done
  [ -f $OUT/bench.log ] && cp -f $OUT/bench.log $FINAL/
  export OUT=$FINAL
  if [[ ${EXTRA:-0} == 1 ]]; then extras; fi
  nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv > $OUT/smi.txt
fi
