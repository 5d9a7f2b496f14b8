#!/usr/bin/env bash
# The GPU check of the tree in as few device calls as possible: a clean device build (or a carried one), the SASS /
# HGMMA check, then every test file, most of them spread over WORKERS pytest processes sharing the one GPU
# (pytest-xdist and pytest-timeout are on the device image; --dist loadfile keeps each file in one process), the rest
# after them in two groups that run side by side, each file alone in its group.
#
# Why: run one after another, the test files took two calls (group A ~530+ s, group B ~280 s) besides the build
# (~120 s), about 17 minutes of a session's 30 device minutes. Most tests are small kernels plus references, so the
# GPU sits idle between them and 16 host cores are there to fill it.
#
# The two groups after the parallel phase hold the files that should not share the GPU with several others:
#   MEMORY: tests that probe free GPU memory (_require_free_memory: their skip would depend on the other workers) or
#           give child processes time limits under ~2 minutes;
#   TOOLS:  compute-sanitizer children (run_sanitizer / run_memcheck, 140 s limits) and the files whose children run
#           them. One MEMORY file and one TOOLS file run at a time: the sanitizer children use little GPU memory.
# Check again when tests are added: grep -l "_require_free_memory\|run_memcheck\|run_sanitizer\|mem_get_info\|timeout=" tests/*_gpu.py
#
#   OUT=$OUT bash scripts/device_check_parallel.sh             # clean build on the device, then the tests
#   PREBUILT=NAME [PACK=stem] ...    # no build: .prebuilt/pack/<stem>.tar.xz holds NAME/_C.abi3.so, NAME/build.log
#   SKIP_BUILD=1 ...                 # the .so already in the tree (no build, no SASS check)
#   PHASES="groups" SKIP_BUILD=1 ... # a second call on the warm machine for what the first left (see summary.txt)
# Environment: PHASES (default "parallel groups"), WORKERS (default 4), BUDGET (seconds for the whole script, default
#   570, inside a 600 s call: each phase's time limit is what is left, and a phase cut short still writes its junit
#   file), PYTEST_K (a -k expression), OUT (at most 7 files: summary.txt, gpu_check.out, kernels.txt, smi.txt,
#   test_logs.tar.gz (pytest logs and junit files), verify_so.tar.xz (the device build, for a later PREBUILT run)).
# Exit status: 0 when the build / SASS check (if run) and every test phase run passed, 1 otherwise.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}  # several pytest processes on 16 cores
OUT=${OUT:-/tmp/fah_check}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
WORKERS=${WORKERS:-4}
PHASES=${PHASES:-parallel groups}
MEMORY="tests/test_bug_reports_gpu.py tests/test_bug_reports_seventh_gpu.py tests/test_bug_reports_more_gpu.py
        tests/test_bug_reports_ninth_gpu.py tests/test_bug_reports_sixth_gpu.py
        tests/test_bug_reports_twentythird_gpu.py"
TOOLS="tests/test_sanitizer_gpu.py tests/test_bug_reports_thirteenth_gpu.py tests/test_head_dims_gpu.py
       tests/test_head_dim_v_gpu.py tests/test_bwd_gqa_group_gpu.py"
T0=$(date +%s)
LOGS=/tmp/fah_check_logs; rm -rf "$LOGS"; mkdir -p "$LOGS"
ign() { for f in $*; do printf -- "--ignore=%s " "$f"; done; }
elapsed() { echo "+$(( $(date +%s) - T0 ))s"; }
left() { echo $(( ${BUDGET:-570} - ($(date +%s) - T0) - ${1:-0} )); }
RC=0

# 1. build (or unpack) and the SASS check, through gpu_check.sh with its test and bench stages off
if [[ ${SKIP_BUILD:-0} == 1 ]]; then
  echo "SKIP_BUILD=1: the tree's flash_attn_hopper/_C.abi3.so, no build or SASS check"
else
  if [[ -n ${PREBUILT:-} ]]; then
    stem=${PACK:-$(echo "$PREBUILT" | tr A-Z a-z)}
    "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" ".prebuilt/pack/$stem.tar.xz" || exit 1
    rm -f flash_attn_hopper/_C*.so; cp ".prebuilt/$PREBUILT/_C.abi3.so" flash_attn_hopper/_C.abi3.so
    export FAH_PREBUILT=1 FAH_BUILD_LOG=$PWD/.prebuilt/$PREBUILT/build.log
  else
    rm -f flash_attn_hopper/_C*.so; rm -rf build .fah_build
  fi
  rm -rf /tmp/fah_gc
  OUT=/tmp/fah_gc FAH_SKIP_TESTS=1 FAH_SKIP_BENCH=1 timeout -k 10 "$(left 300)" bash scripts/gpu_check.sh \
    > "$OUT/gpu_check.out" 2>&1
  rc=$?; echo "build/sass rc $rc ($(elapsed))"; (( rc == 0 )) || RC=1
  grep -E "^(build|sass|cutlass) |HGMMA check" "$OUT/gpu_check.out" | tail -n 8
  cp -f /tmp/fah_gc/kernels.txt "$OUT/" 2>/dev/null
  if [[ -z ${PREBUILT:-} && -f flash_attn_hopper/_C.abi3.so ]]; then
    "$PY" - "$OUT" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[1] + "/verify_so.tar.xz", "w:xz", preset=1) as t:
    t.add("flash_attn_hopper/_C.abi3.so", "VERIFY/_C.abi3.so")
    t.add(".fah_build/gpu_check/build.log", "VERIFY/build.log")
PY
  fi
fi
if [[ ! -f flash_attn_hopper/_C.abi3.so ]]; then echo "no extension in the tree: stopping"; exit 1; fi

# 2. the tests. SIGINT at a phase's limit lets pytest write its junit file (-k: KILL 20 s later).
K=(); if [[ -n ${PYTEST_K:-} ]]; then K=(-k "$PYTEST_K"); fi
COMMON=(-q -rs -p no:cacheprovider --timeout 300 --timeout-method thread --durations=15 "${K[@]}")
run_phase() {  # name limit pytest-args...: returns 0 when pytest exits 0 or 5 (nothing selected), else 1
  local name=$1 limit=$2; shift 2
  if (( limit < 30 )); then echo "$name: no time left (summary.txt lists the files with no result)"; return 1; fi
  timeout -s INT -k 20 "$limit" "$PY" -m pytest "${COMMON[@]}" --junitxml="$LOGS/junit_$name.xml" "$@" \
    > "$LOGS/pytest_$name.log" 2>&1
  local rc=$?
  echo "$name rc $rc ($(elapsed))"; tail -n 2 "$LOGS/pytest_$name.log"
  (( rc == 0 || rc == 5 ))
}
if [[ " $PHASES " == *" parallel "* ]]; then
  # --timeout-method thread ends a hung test's worker; xdist reports it and starts another worker
  run_phase parallel "$(left 60)" tests -n "$WORKERS" --dist loadfile $(ign $MEMORY $TOOLS) || RC=1
fi
if [[ " $PHASES " == *" groups "* ]]; then
  lim=$(left 20)
  # -n 1: a worker process, so that a test ended by the per-test timeout does not lose the group's junit file
  run_phase memory "$lim" $MEMORY -n 1 & p1=$!
  run_phase tools "$lim" $TOOLS -n 1 & p2=$!
  wait $p1 || RC=1
  wait $p2 || RC=1
fi

# 3. summary: counts, failures, skip reasons, files with no result (not reached), the slowest files
"$PY" - "$LOGS" "$MEMORY $TOOLS" <<'PY' | tee "$OUT/summary.txt"
import collections, glob, os, sys, xml.etree.ElementTree as ET
logs, grouped = sys.argv[1], sys.argv[2].split()
total = collections.Counter(); per_file = collections.defaultdict(float); bad = []; skips = collections.Counter()
seen = set()
for path in sorted(glob.glob(f"{logs}/junit_*.xml")):
    for case in ET.parse(path).iter("testcase"):
        if not case.get("name"):  # the empty record pytest writes for a run interrupted by the phase's time limit
            total["interrupted (no test name)"] += 1
            continue
        cls = case.get("classname", "")
        f = cls.split(".")[1] if cls.count(".") >= 1 else cls
        seen.add(f); per_file[f] += float(case.get("time", 0))
        kind = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                kind = "failed"; bad.append(f"{cls}::{case.get('name')}: {(child.get('message') or '')[:200]}")
            elif child.tag == "skipped" and child.get("type") == "pytest.xfail":
                kind = "xfailed"  # a strict expected failure that failed as marked (JUnit writes it as skipped)
            elif child.tag == "skipped":
                kind = "skipped"; skips[(child.get("message") or "")[:160]] += 1
        total[kind] += 1
print("junit files:", ", ".join(os.path.basename(p) for p in sorted(glob.glob(f"{logs}/junit_*.xml"))) or "none")
print("tests:", ", ".join(f"{v} {k}" for k, v in sorted(total.items())) or "none")
for b in bad[:30]:
    print("  FAILED", b)
for msg, n in skips.most_common(12):
    print(f"  skipped x{n}: {msg}")
files = sorted(os.path.basename(p)[:-3] for p in glob.glob("tests/test_*.py"))
missing = [f for f in files if f not in seen]
print("test files with no result (not reached, or every test deselected):", " ".join(missing) or "none")
print("slowest files (s):", ", ".join(f"{f} {t:.0f}" for f, t in sorted(per_file.items(), key=lambda x: -x[1])[:12]))
PY
tar czf "$OUT/test_logs.tar.gz" -C "$LOGS" . 2>/dev/null
echo "done ($(elapsed)), exit $RC"
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv > "$OUT/smi.txt" 2>/dev/null || true
exit $RC
