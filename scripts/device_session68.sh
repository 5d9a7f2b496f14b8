#!/usr/bin/env bash
# Session 68's one device call (most of the session's device time went to machines that did not start or were taken
# back), on pack FIN2 (the head's kernels: FIN's main kernels, tested in full in session 67, plus the exact pass in
# natural units and the backward preprocess's NaN for an LSE past the log2 range): the SASS / HGMMA check; the files
# that exercise what FIN2 adds and round 34 (at most 220 s); on an H200 the grid (its README figures are session
# 63's; dense only when less than 190 s is left); then as much of the parallel phase as the budget leaves (not the
# memory and tools groups: a second call, PHASES=groups SKIP_BUILD=1). At most BUDGET s; the SASS step's BUDGET of
# 340 leaves gpu_check.sh its 40 s (device_check_parallel.sh gives it BUDGET - 300).
#   carry [".prebuilt/pack/fin2.tar.xz", ".whl"] (another PACK: its own tar.xz); OUT as the device gives it; BUDGET
#   (default 555).
# Environment: PREBUILT / PACK (default FIN2 / fin2: another pack, e.g. session 70's DOCAL / docal; PREBUILT=BUILD: a
#   clean device build, no pack), GRID_FEATURES (the grid's --features), GRID_FP16 (0: no fp16 grid), FIRST (the first
#   files), GRID (0: no grid), REST_PHASES (default "parallel"; "parallel groups" adds the memory and tools groups).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4  # several pytest processes on 16 cores
OUT=${OUT:-/tmp/s68}; mkdir -p "$OUT"
BUDGET=${BUDGET:-555}
T0=$(date +%s); el() { echo "+$(( $(date +%s) - T0 ))s"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) - ${1:-0} )); }
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "gpu: $GPU; nproc $(nproc)"
PREBUILT=${PREBUILT:-FIN2}; PACK=${PACK:-fin2}
if [[ $PREBUILT == BUILD ]]; then  # a clean device build (~2 minutes); OUT/check/verify_so.tar.xz brings it back
  env -u PREBUILT -u PACK PHASES=none BUDGET=480 OUT="$OUT/check" bash scripts/device_check_parallel.sh \
    > "$OUT/check.txt" 2>&1
  build_log=$PWD/.fah_build/gpu_check/build.log
else
  PREBUILT=$PREBUILT PACK=$PACK PHASES=none BUDGET=340 OUT="$OUT/check" bash scripts/device_check_parallel.sh \
    > "$OUT/check.txt" 2>&1
  build_log=$PWD/.prebuilt/$PREBUILT/build.log
fi
echo "sass $(el): $(grep -m1 'HGMMA check' "$OUT/check.txt");" \
  "$(grep -m1 -o 'spills: [0-9]* kernel(s) spill' "$OUT/check.txt")"
export FAH_PREBUILT=1 FAH_BUILD_LOG=$build_log
FIRST=${FIRST:-"tests/test_bug_reports_thirtysixth_gpu.py tests/test_bug_reports_thirtyfifth_gpu.py
       tests/test_bug_reports_thirtyfourth_gpu.py tests/test_bug_reports_thirtysecond_gpu.py tests/test_bwd_gpu.py
       tests/test_deterministic_gpu.py tests/test_transformers_gpu.py tests/test_bug_reports_fifth_gpu.py"}
lim=$(left 10); (( lim > 220 )) && lim=220
timeout -s INT -k 10 "$lim" python3 -m pytest -q -rs -p no:cacheprovider -n 4 --dist loadfile $FIRST \
  --timeout 200 --timeout-method thread --junitxml="$OUT/j_first.xml" > "$OUT/first.log" 2>&1
echo "first files rc $? $(el): $(tail -n 1 "$OUT/first.log")"; grep -E "^(FAILED|ERROR)" "$OUT/first.log" | head -30
# on an H200 the full grid with the feature points, else dense only
if [[ $GPU == *H200* ]] && [[ ${GRID:-1} != 0 ]] && (( $(left) > 60 )); then
  feats=dense; (( $(left) > 190 )) && feats=dense,gqa,varlen,window,softcap,deterministic
  feats=${GRID_FEATURES:-$feats}
  timeout "$(left 5)" python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 --direction both \
    --features $feats --no-bar --json "$OUT/grid_S68.json" --summary "$OUT/grid_S68_summary.md" > "$OUT/grid.log" 2>&1
  echo "grid ($feats) rc $? $(el)"
  if [[ ${GRID_FP16:-1} != 0 ]] && (( $(left) > 60 )); then
    timeout "$(left 5)" python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 --direction both \
      --dtype fp16 --features dense --no-bar --json "$OUT/grid_S68_fp16.json" \
      --summary "$OUT/grid_S68_fp16_summary.md" > "$OUT/grid_fp16.log" 2>&1
    echo "grid fp16 rc $? $(el)"
  fi
fi
if (( $(left) > 120 )); then
  ign="--ignore-glob=tests/*_cpu.py"; for f in $FIRST; do ign+=" --ignore=$f"; done  # CI runs the CPU files
  PYTEST_ADDOPTS="$ign" SKIP_BUILD=1 PHASES=${REST_PHASES:-parallel} BUDGET=$(left 5) OUT="$OUT/rest" \
    bash scripts/device_check_parallel.sh > "$OUT/rest.txt" 2>&1
  echo "rest rc $? $(el)"; tail -n 12 "$OUT/rest/summary.txt" 2>/dev/null
fi
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv > "$OUT/smi.txt" 2>/dev/null
echo "done $(el)"
