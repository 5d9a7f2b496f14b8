#!/usr/bin/env bash
# Session 54's first device call (one warm machine, under 600 s), after session 53 got none: the GPU files the
# submitted tree has never run (the twentieth, twenty-first, twenty-third and, since session 55, twenty-fourth / -fifth
# bug-report rounds, test_compile_gpu.py with EY's fake-kernel checks) on S52 (the head's C++), then the head_dim 128
# A/B of S52 against DQ1 (dQ on one consumer warpgroup, branch dq1wg) and DQ1K (dK first), 2 rounds at 4096 / 16384,
# then the grid on S52.
#   carry [".prebuilt/pack/s52.tar.xz", ".prebuilt/pack/dq1.tar.xz", ".prebuilt/pack/dq1k.tar.xz"]
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/s54}; mkdir -p "$OUT"
python3 -c "import tarfile; [tarfile.open(f'.prebuilt/pack/{s}.tar.xz').extractall('.prebuilt') for s in ('s52', 'dq1', 'dq1k')]" \
  || exit 1
cp -f .prebuilt/S52/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv | tee "$OUT/smi.txt"
T0=$(date +%s)
FAH_PREBUILT=1 FAH_BUILD_LOG=$PWD/.prebuilt/S52/build.log timeout ${TESTS_S:-230} python3 -m pytest -q \
  -p no:cacheprovider -n 4 --dist loadfile tests/test_bug_reports_twentieth_gpu.py \
  tests/test_bug_reports_twentyfirst_gpu.py tests/test_bug_reports_twentythird_gpu.py \
  tests/test_bug_reports_twentyfourth_gpu.py tests/test_bug_reports_twentyfifth_gpu.py tests/test_compile_gpu.py --timeout 150 --timeout-method thread \
  --junitxml="$OUT/tests_junit.xml" > "$OUT/tests.txt" 2>&1
echo "tests rc $? ($(tail -n 1 "$OUT/tests.txt")) +$(( $(date +%s) - T0 ))s"
CASES="S52;DQ1;DQ1K" DIRECTION=bwd ROUNDS=2 TAG=dq1 OUT=$OUT BENCH_TIMEOUT=60 \
  BENCH="--head-dims 128 --causal both --features dense --seqlens 4096,16384 --no-check --no-adjacent" \
  timeout ${AB_S:-200} bash scripts/device_env_ab.sh > "$OUT/ab_dq1.txt" 2>&1
echo "dq1 a/b rc $? +$(( $(date +%s) - T0 ))s"
cp -f .prebuilt/S52/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
timeout ${GRID_S:-140} python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 --direction both --no-bar \
  --json "$OUT/grid_S52.json" --summary "$OUT/grid_S52_summary.md" > "$OUT/grid.log" 2>&1
echo "grid rc $? +$(( $(date +%s) - T0 ))s"
