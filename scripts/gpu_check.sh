#!/usr/bin/env bash
# GPU check: one command on an H100/H200 machine without network access.
#
#   bash scripts/gpu_check.sh
#
# Stages (each runs even when an earlier one failed, where it can; logs are always kept):
#   env     GPU, driver, python/torch/CUDA/cuDNN/triton versions, nvcc, git commit
#   cutlass install the nvidia-cutlass wheel from .whl/ (shared tools/cutlass_wheel.sh puts it there) with
#           pip --no-index --no-deps, into the interpreter's site-packages or, when that is read-only, into
#           .fah_build/site (added to PYTHONPATH). Skipped when CUTLASS_PATH points at a CUTLASS tree.
#   build   python3 setup.py build_ext --inplace with MAX_JOBS=$(nproc) and FAH_PTXAS_VERBOSE=1, from a clean
#           build directory (.fah_build/build_temp); the .so lands in flash_attn_hopper/. Timed; full log kept.
#   sass    cuobjdump --dump-sass of the .so: HGMMA count per kernel (fails if a forward kernel has none),
#           and registers / stack / spills per kernel from the ptxas report in the build log (spills flagged;
#           fails if ptxas serialized the wgmma of any kernel).
#   tests   python3 -m pytest tests -q -rs --durations=5 (with junit xml), PYTHONPATH = repo root
#   bench   python3 -m flash_attn_hopper.benchmark $BENCH_ARGS (forward and backward; the grid of
#           shared/baselines.md plus feature points, skipped with the reason until the features exist), with
#           --plots/--summary when matplotlib imports and --compare $BENCH_BASELINE when set (exit 1 = regression).
#           $OUT gets bench_attention.json and bench_extra.tar.gz (bench.log, PNGs, summary.md); bench.log stays
#           in $OUT alone only when the run is cut short.
# Then copies logs, JSON and the kernel report into $OUT if set, and prints a short summary LAST.
#
# Environment:
#   FAH_PREBUILT=1       use the flash_attn_hopper/_C*.so already in the tree (no build; the ptxas report comes
#                        from FAH_BUILD_LOG, or the previous build log in .fah_build/gpu_check/ if there is one)
#   FAH_EXPORT_SO=1      also copy the built .so into $OUT (in place of sass.txt.gz), e.g. to carry it into a
#                        later FAH_PREBUILT=1 run
#   FAH_INCREMENTAL=1    keep .fah_build/build_temp (ninja rebuilds only what changed; the ptxas report then
#                        covers only the recompiled files)
#   FAH_HDIMS, FAH_DTYPES, CUTLASS_PATH, MAX_JOBS   passed to setup.py (see its docstring)
#   FAH_SKIP_TESTS=1, FAH_SKIP_BENCH=1              skip a stage
#   PYTEST_ARGS          extra pytest arguments (e.g. "-x -k causal")
#   BENCH_ARGS           benchmark arguments (e.g. "--head-dims 128 --seqlens 4096,16384 --causal no")
#   BENCH_BASELINE       a previous bench_attention.json: compare with it (--compare), fail the stage on regression
#   BENCH_THRESHOLD      allowed slowdown per point for BENCH_BASELINE (default 0.05)
#   FAH_HGMMA_KERNEL_REGEX / FAH_HGMMA_EXCLUDE_REGEX  which kernels must hold HGMMA (default: the fwd and bwd main kernels)
#   FAH_FAIL_ON_SPILL=1  make a spilling kernel fail the sass stage (default: flagged only)
#   PYTHON               interpreter (default python3)
#   OUT                  folder to copy results into (at most 8 files)
# Exit status: 0 when every stage that ran passed; 1 otherwise.

set -uo pipefail
export PYTHONUNBUFFERED=1

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
WORK=$ROOT/.fah_build/gpu_check
mkdir -p "$WORK"
OUT=${OUT:-}
if [[ -n $OUT ]]; then mkdir -p "$OUT"; fi
T_START=$(date +%s)

# The interpreter's own bin/ first (ninja, pytest of that environment), then CUDA's (nvcc, cuobjdump).
PY_BIN=$(dirname "$("$PY" -c 'import sys; print(sys.executable)' 2>/dev/null || command -v "$PY")")
if [[ -z ${CUDA_HOME:-} ]]; then
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then
    CUDA_HOME=/usr/local/cuda
  elif command -v nvcc >/dev/null; then
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  fi
fi
if [[ -n ${CUDA_HOME:-} ]]; then export CUDA_HOME; fi
export PATH="$PY_BIN:${CUDA_HOME:+$CUDA_HOME/bin:}$PATH"

declare -A STATUS=() DETAIL=()
STAGES=(env cutlass build sass tests bench)
for s in "${STAGES[@]}"; do STATUS[$s]="not run"; DETAIL[$s]=""; done

banner() { printf '\n======== %s  [%s, +%ss]\n' "$1" "$(date -u +%H:%M:%S)" "$(( $(date +%s) - T_START ))"; }
# tee into the work folder and, live, into $OUT: what a killed run printed still comes back.
tee_log() { if [[ -n $OUT ]]; then tee "$WORK/$1" "$OUT/$1"; else tee "$WORK/$1"; fi; }
to_out() { if [[ -n $OUT && -f $1 ]]; then cp -f "$1" "$OUT/${2:-$(basename "$1")}"; fi; }
so_path() { compgen -G "$ROOT/flash_attn_hopper/_C*.so" | head -n 1; }

# ---------------------------------------------------------------------------------------------------------- env
banner "env"
{
  echo "date:     $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host:     $(hostname)  cores: $(nproc)  mem: $(free -g 2>/dev/null | awk '/^Mem:/{print $2 " GiB"}')"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | sed 's/^/gpu:      /'
  else
    echo "gpu:      nvidia-smi not found"
  fi
  echo "python:   $PY -> $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])' 2>&1)"
  "$PY" - <<'EOF' 2>&1
import torch
print(f"torch:    {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
      f"cuda available: {torch.cuda.is_available()})")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device:   {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
try:
    import triton
    print(f"triton:   {triton.__version__}")
except Exception as e:
    print(f"triton:   not importable ({e})")
EOF
  echo "nvcc:     $(nvcc --version 2>&1 | grep -i release || echo 'not found') (CUDA_HOME=${CUDA_HOME:-unset})"
  echo "ninja:    $(ninja --version 2>&1 || echo 'not found: the build falls back to a slow serial compile')"
  echo "cuobjdump: $(command -v cuobjdump || echo 'not found')"
  if git -C "$ROOT" rev-parse HEAD >/dev/null 2>&1; then
    echo "commit:   $(git -C "$ROOT" rev-parse HEAD)$( [[ -n $(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null) ]] && echo ' (dirty)')"
  else
    echo "commit:   n/a (no git metadata)"
  fi
  echo "knobs:    FAH_HDIMS=${FAH_HDIMS:-all} FAH_DTYPES=${FAH_DTYPES:-all} FAH_PREBUILT=${FAH_PREBUILT:-0} BENCH_ARGS=${BENCH_ARGS:-}"
} 2>&1 | tee "$WORK/env.txt"
STATUS[env]=ok

# ------------------------------------------------------------------------------------------------------ cutlass
banner "cutlass"
cutlass_ok() {
  "$PY" -c 'import os, cutlass_library as c; p = c.source_path; assert os.path.isfile(os.path.join(p, "include", "cute", "tensor.hpp")), p; print("cutlass_library at", p)'
}
if [[ -n ${CUTLASS_PATH:-} ]]; then
  if [[ -f $CUTLASS_PATH/include/cute/tensor.hpp ]]; then
    STATUS[cutlass]=ok; DETAIL[cutlass]="CUTLASS_PATH=$CUTLASS_PATH"
  else
    STATUS[cutlass]=FAILED; DETAIL[cutlass]="CUTLASS_PATH=$CUTLASS_PATH has no include/cute/tensor.hpp"
  fi
else
  WHL=$(compgen -G "$ROOT/.whl/nvidia_cutlass-*.whl" | sort -V | tail -n 1)
  if [[ -z $WHL ]]; then
    if cutlass_ok; then
      STATUS[cutlass]=ok; DETAIL[cutlass]="no wheel in .whl/; using the nvidia-cutlass already installed"
    else
      STATUS[cutlass]=FAILED
      DETAIL[cutlass]="no .whl/nvidia_cutlass-*.whl: on a machine with network, in the repo root: pip download --no-deps --only-binary=:all: -d .whl nvidia-cutlass==4.2.0.0 (docs/gpu_check_and_benchmark.md, GPU check), then bring .whl/ here"
    fi
  else
    SITE_WRITABLE=$("$PY" -c 'import os, sysconfig; print(int(os.access(sysconfig.get_paths()["purelib"], os.W_OK)))' 2>/dev/null || echo 0)
    if [[ $SITE_WRITABLE == 1 ]]; then
      "$PY" -m pip install --no-index --no-deps --disable-pip-version-check "$WHL"
      rc=$?
    else
      rc=1
    fi
    if [[ $rc != 0 ]]; then
      TARGET=$ROOT/.fah_build/site
      echo "installing into $TARGET (site-packages not writable or pip failed)"
      "$PY" -m pip install --no-index --no-deps --disable-pip-version-check --upgrade --target "$TARGET" "$WHL" \
        || "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$WHL" "$TARGET"
      export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
    fi
    if cutlass_ok; then
      STATUS[cutlass]=ok; DETAIL[cutlass]="$(basename "$WHL")${TARGET:+ -> $TARGET}"
    else
      STATUS[cutlass]=FAILED; DETAIL[cutlass]="$(basename "$WHL") installed but cutlass_library does not import"
    fi
  fi
fi
echo "cutlass: ${STATUS[cutlass]} ${DETAIL[cutlass]}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# -------------------------------------------------------------------------------------------------------- build
banner "build"
BUILD_S=""
if [[ ${FAH_PREBUILT:-0} == 1 ]]; then
  SO=$(so_path)
  if [[ -n $SO ]]; then
    STATUS[build]=ok; DETAIL[build]="prebuilt $(basename "$SO") ($(date -u -r "$SO" +%Y-%m-%dT%H:%M:%SZ))"
    if [[ -n ${FAH_BUILD_LOG:-} && -f $FAH_BUILD_LOG && $FAH_BUILD_LOG -ef $WORK/build.log ]]; then :
    elif [[ -n ${FAH_BUILD_LOG:-} && -f $FAH_BUILD_LOG ]]; then cp -f "$FAH_BUILD_LOG" "$WORK/build.log"; fi
    if [[ -f $WORK/build.log ]]; then to_out "$WORK/build.log"; fi
  else
    STATUS[build]=FAILED; DETAIL[build]="FAH_PREBUILT=1 but no flash_attn_hopper/_C*.so in the tree"
  fi
elif [[ ${STATUS[cutlass]} != ok ]]; then
  STATUS[build]=FAILED; DETAIL[build]="not attempted: no CUTLASS headers"
  rm -f "$ROOT"/flash_attn_hopper/_C*.so
else
  rm -f "$ROOT"/flash_attn_hopper/_C*.so   # never test a stale build
  if [[ ${FAH_INCREMENTAL:-0} != 1 ]]; then rm -rf "$ROOT/.fah_build/build_temp"; fi
  JOBS=${MAX_JOBS:-$(nproc)}
  echo "MAX_JOBS=$JOBS FAH_PTXAS_VERBOSE=1 $PY setup.py build_ext --inplace --build-temp .fah_build/build_temp"
  t0=$(date +%s)
  MAX_JOBS=$JOBS FAH_PTXAS_VERBOSE=1 "$PY" setup.py build_ext --inplace --build-temp .fah_build/build_temp 2>&1 | tee_log build.log
  rc=${PIPESTATUS[0]}
  BUILD_S=$(( $(date +%s) - t0 ))
  SO=$(so_path)
  if [[ $rc == 0 && -n $SO ]]; then
    STATUS[build]=ok; DETAIL[build]="$(basename "$SO"), $(du -h "$SO" | cut -f1), ${BUILD_S}s with MAX_JOBS=$JOBS"
  else
    STATUS[build]=FAILED; DETAIL[build]="exit $rc after ${BUILD_S}s (see build.log)"
    grep -n -m 20 -E 'error|FAILED:' "$WORK/build.log" | cut -c1-300
  fi
fi
echo "build: ${STATUS[build]} ${DETAIL[build]}"
SO=$(so_path)

# --------------------------------------------------------------------------------------------------------- sass
banner "sass"
if [[ -z $SO ]]; then
  STATUS[sass]="skipped"; DETAIL[sass]="no extension"
elif ! command -v cuobjdump >/dev/null; then
  STATUS[sass]=FAILED; DETAIL[sass]="cuobjdump not found"
else
  cuobjdump --dump-sass "$SO" >"$WORK/sass.txt" 2>"$WORK/cuobjdump.err"
  rc=$?
  SPILL_FLAG=(); if [[ ${FAH_FAIL_ON_SPILL:-0} == 1 ]]; then SPILL_FLAG=(--fail-on-spill); fi
  PTXAS_ARGS=(); if [[ -f $WORK/build.log ]]; then PTXAS_ARGS=(--ptxas-log "$WORK/build.log"); fi
  if [[ $rc != 0 ]]; then
    STATUS[sass]=FAILED; DETAIL[sass]="cuobjdump exit $rc: $(head -c 300 "$WORK/cuobjdump.err")"
  else
    "$PY" "$ROOT/scripts/kernel_report.py" --sass "$WORK/sass.txt" "${PTXAS_ARGS[@]}" "${SPILL_FLAG[@]}" \
      --fail-on-serialized --out "$WORK/kernels.txt"
    rc=$?
    if [[ $rc == 0 ]]; then STATUS[sass]=ok; else STATUS[sass]=FAILED; fi
    DETAIL[sass]="$(grep -m1 '^HGMMA check' "$WORK/kernels.txt" 2>/dev/null); $(grep -m1 '^spills' "$WORK/kernels.txt" 2>/dev/null)"
    to_out "$WORK/kernels.txt"
    gzip -c "$WORK/sass.txt" >"$WORK/sass.txt.gz"
    if [[ ${FAH_EXPORT_SO:-0} != 1 ]] && (( $(stat -c %s "$WORK/sass.txt.gz") <= 8 * 1024 * 1024 )); then
      to_out "$WORK/sass.txt.gz"
    fi
  fi
fi
echo "sass: ${STATUS[sass]} ${DETAIL[sass]}"
if [[ ${FAH_EXPORT_SO:-0} == 1 && -n $SO ]]; then to_out "$SO"; fi

# -------------------------------------------------------------------------------------------------------- tests
banner "tests"
TEST_COUNTS=""
if [[ ${FAH_SKIP_TESTS:-0} == 1 ]]; then
  STATUS[tests]="skipped"; DETAIL[tests]="FAH_SKIP_TESTS=1"
else
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
  "$PY" -m pytest tests -q -rs --durations=5 --junitxml="$WORK/junit.xml" ${PYTEST_ARGS:-} 2>&1 | tee_log pytest.log
  rc=${PIPESTATUS[0]}
  TEST_COUNTS=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error|errors|deselected|xfailed|xpassed)|no tests ran' \
    "$WORK/pytest.log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
  to_out "$WORK/junit.xml"
  if [[ $rc == 0 ]]; then
    STATUS[tests]=ok
  elif [[ $rc == 5 ]]; then
    STATUS[tests]=FAILED; TEST_COUNTS="no tests collected (pytest exit 5)"
  else
    STATUS[tests]=FAILED
  fi
  DETAIL[tests]="${TEST_COUNTS:-pytest exit $rc}"
fi
echo "tests: ${STATUS[tests]} ${DETAIL[tests]}"

# -------------------------------------------------------------------------------------------------------- bench
banner "bench"
if [[ ${FAH_SKIP_BENCH:-0} == 1 ]]; then
  STATUS[bench]="skipped"; DETAIL[bench]="FAH_SKIP_BENCH=1"
elif [[ -z $SO ]]; then
  STATUS[bench]="skipped"; DETAIL[bench]="no extension"
else
  rm -rf "$WORK/bench_attention.json" "$WORK/bench"
  mkdir -p "$WORK/bench"
  EXTRA_ARGS=()
  if "$PY" -c 'import matplotlib' 2>/dev/null; then
    EXTRA_ARGS+=(--plots "$WORK/bench" --summary "$WORK/bench/summary.md")
  else
    echo "matplotlib not importable: no plots" >&2
    EXTRA_ARGS+=(--summary "$WORK/bench/summary.md")
  fi
  if [[ -n ${BENCH_BASELINE:-} ]]; then
    EXTRA_ARGS+=(--compare "$BENCH_BASELINE" --threshold "${BENCH_THRESHOLD:-0.05}")
  fi
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
  "$PY" -m flash_attn_hopper.benchmark ${BENCH_ARGS:-} --json "$WORK/bench_attention.json" "${EXTRA_ARGS[@]}" 2>&1 \
    | tee_log bench.log
  rc=${PIPESTATUS[0]}
  to_out "$WORK/bench_attention.json"
  if [[ -n $OUT ]]; then  # one archive keeps $OUT at 8 files
    cp -f "$WORK/bench.log" "$WORK/bench/bench.log"
    if tar -czf "$OUT/bench_extra.tar.gz" -C "$WORK" bench; then rm -f "$OUT/bench.log"; fi
  fi
  if [[ $rc == 0 ]]; then STATUS[bench]=ok; else STATUS[bench]=FAILED; fi
  DETAIL[bench]="exit $rc"
  if [[ $rc == 1 && -n ${BENCH_BASELINE:-} ]]; then DETAIL[bench]="exit 1: slower than $BENCH_BASELINE (see compare:)"; fi
fi
echo "bench: ${STATUS[bench]} ${DETAIL[bench]}"

# ------------------------------------------------------------------------------------------------------ summary
FAILED=0
for s in "${STAGES[@]}"; do
  if [[ ${STATUS[$s]} == FAILED ]]; then FAILED=1; fi
done
{
  echo "==================== GPU check summary ===================="
  grep -E '^(date|gpu|device|torch|triton|nvcc|commit|knobs):' "$WORK/env.txt"
  echo
  for s in "${STAGES[@]:1}"; do printf '%-8s %-8s %s\n' "$s" "${STATUS[$s]}" "${DETAIL[$s]}"; done
  echo
  echo "build time: ${BUILD_S:-n/a}${BUILD_S:+ s} (MAX_JOBS=${MAX_JOBS:-$(nproc)}, $(nproc) cores)"
  if [[ -f $WORK/kernels.txt && ${STATUS[sass]} != skipped ]]; then
    echo
    echo "kernels (scripts/kernel_report.py; names and HGMMA shapes in kernels.txt):"
    grep -E '^\|' "$WORK/kernels.txt" | head -n 26
    grep -E '^(HGMMA check|spills|  FAIL|  FLAG)' "$WORK/kernels.txt" | head -n 20 | cut -c1-240
  fi
  echo
  echo "tests: ${TEST_COUNTS:-${DETAIL[tests]}}"
  if [[ -f $WORK/pytest.log ]]; then
    grep -E '^SKIPPED' "$WORK/pytest.log" | head -n 8 | cut -c1-240
    # The one CPU-only test that needs the extension absent skips by design ("the extension is loaded here").
    if grep '^SKIPPED' "$WORK/pytest.log" | grep -vq 'extension is loaded here' && command -v nvidia-smi >/dev/null; then
      echo "note: tests were skipped on a GPU machine; on an H100/H200 with the extension built no GPU test should skip"
    fi
    grep -E '^(FAILED|ERROR) ' "$WORK/pytest.log" | head -n 15 | cut -c1-240
  fi
  if [[ -f $WORK/bench.log && ${STATUS[bench]} != skipped ]]; then
    echo
    grep -E '^# attention' "$WORK/bench.log" | head -n 1
    awk '/^\|/ {p = 1; print; next} p {exit}' "$WORK/bench.log"   # the first table (not the compare table)
    grep -E '^(! =|ours n/a|cuDNN n/a|FA2 n/a|[a-z]+ skipped \(|SM clock)' "$WORK/bench.log" | cut -c1-240
    grep -E '^compare: ' "$WORK/bench.log" | cut -c1-1200
  fi
  echo
  echo "total $(( $(date +%s) - T_START ))s; result: $([[ $FAILED == 0 ]] && echo PASS || echo FAIL)"
  echo "logs: $WORK${OUT:+ (copied to $OUT)}"
} >"$WORK/summary.txt"
to_out "$WORK/summary.txt"
if [[ -n $OUT ]]; then
  # what comes back from $OUT: at most 8 files of at most 16 MiB each
  for f in "$OUT"/*; do
    if [[ -f $f && $f != *.gz ]] && (( $(stat -c %s "$f") > 15 * 1024 * 1024 )); then gzip -f "$f"; fi
  done
fi
echo
cat "$WORK/summary.txt"
exit "$FAILED"
