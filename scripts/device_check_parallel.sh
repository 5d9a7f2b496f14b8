#!/usr/bin/env bash
# The GPU check of the tree in ONE device call: a clean device build (or a carried one), the SASS / HGMMA check, then
# every test file, most of them spread over WORKERS pytest processes sharing the one GPU (pytest-xdist is on the
# device image; --dist loadfile keeps each file in one process), the rest alone afterwards.
#
# Why: run one after another, the test files took two calls (group A ~530+ s, group B ~280 s) besides the build
# (~120 s), about 17 minutes of a session's 30 device minutes. Most tests are small kernels plus CPU-side
# references, so the GPU sits idle between them and 16 host cores are there to fill it.
#
# SERIAL files run alone, after the parallel phase: those that measure free GPU memory (their skip would depend on the
# other workers), run compute-sanitizer children, or give a child process a time limit under about two minutes.
#
#   bash scripts/device_check_parallel.sh                    # clean build on the device, then the tests
#   PREBUILT=NAME [PACK=stem] bash scripts/device_check_parallel.sh
#                       # no build: .prebuilt/pack/<stem>.tar.xz holding NAME/_C.abi3.so and NAME/build.log
#                       # (stem defaults to the lower-cased NAME; carry the pack)
# Environment: SKIP_BUILD=1 (the .so already in the tree; no build, no SASS check), WORKERS (default 4), PAR_TIMEOUT / SERIAL_TIMEOUT (seconds for each test phase; defaults 330 / 200),
#   PYTEST_K (a -k expression for both phases), OUT (results: summary.txt, build log, pytest logs, junit with the
#   per-test durations, the build as verify_so.tar.xz for a later PREBUILT run).
# Exit status: 0 when both test phases passed (pytest exit 0), 1 otherwise.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/fah_check}; mkdir -p "$OUT"
WORKERS=${WORKERS:-4}
SERIAL="tests/test_sanitizer_gpu.py tests/test_bug_reports_thirteenth_gpu.py tests/test_bug_reports_gpu.py
        tests/test_bug_reports_ninth_gpu.py tests/test_bug_reports_sixth_gpu.py tests/test_fwd_tiles_gpu.py"
T0=$(date +%s)
ign() { for f in $*; do printf -- "--ignore=%s " "$f"; done; }
elapsed() { echo "+$(( $(date +%s) - T0 ))s"; }

# 1. build (or unpack) and the SASS check, through gpu_check.sh with its test and bench stages off
rm -rf "$OUT/gc"; mkdir -p "$OUT/gc"
if [[ ${SKIP_BUILD:-0} == 1 ]]; then
  echo "SKIP_BUILD=1: the tree's flash_attn_hopper/_C.abi3.so, no build or SASS check"
elif [[ -n ${PREBUILT:-} ]]; then
  stem=${PACK:-$(echo "$PREBUILT" | tr A-Z a-z)}
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" ".prebuilt/pack/$stem.tar.xz" || exit 1
  rm -f flash_attn_hopper/_C*.so; cp ".prebuilt/$PREBUILT/_C.abi3.so" flash_attn_hopper/_C.abi3.so
  export FAH_PREBUILT=1 FAH_BUILD_LOG=$PWD/.prebuilt/$PREBUILT/build.log
else
  rm -f flash_attn_hopper/_C*.so; rm -rf build .fah_build
fi
if [[ ${SKIP_BUILD:-0} != 1 ]]; then
  OUT=$OUT/gc FAH_SKIP_TESTS=1 FAH_SKIP_BENCH=1 timeout "${BUILD_TIMEOUT:-300}" bash scripts/gpu_check.sh > "$OUT/gpu_check.out" 2>&1
  echo "build/sass rc $? ($(elapsed))"
  grep -E "^(build|sass|cutlass) |HGMMA check" "$OUT/gpu_check.out" | tail -n 8
fi
if [[ ! -f flash_attn_hopper/_C.abi3.so ]]; then echo "no extension in the tree: stopping"; exit 1; fi
if [[ -z ${PREBUILT:-} && ${SKIP_BUILD:-0} != 1 ]]; then
  python3 - "$OUT" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[1] + "/verify_so.tar.xz", "w:xz", preset=1) as t:
    t.add("flash_attn_hopper/_C.abi3.so", "VERIFY/_C.abi3.so")
    t.add(".fah_build/gpu_check/build.log", "VERIFY/build.log")
PY
fi

# 2. the tests: most files in parallel, then SERIAL alone
K=(); if [[ -n ${PYTEST_K:-} ]]; then K=(-k "$PYTEST_K"); fi
COMMON=(-q -rs -p no:cacheprovider --timeout 300 --timeout-method thread --durations=15)
timeout "${PAR_TIMEOUT:-330}" ${PYTHON:-python3} -m pytest tests "${COMMON[@]}" "${K[@]}" -n "$WORKERS" --dist loadfile \
  --junitxml="$OUT/junit_parallel.xml" $(ign $SERIAL) > "$OUT/pytest_parallel.log" 2>&1
RC_PAR=$?; echo "parallel phase rc $RC_PAR ($(elapsed))"; tail -n 3 "$OUT/pytest_parallel.log"
timeout "${SERIAL_TIMEOUT:-200}" ${PYTHON:-python3} -m pytest $SERIAL "${COMMON[@]}" "${K[@]}" \
  --junitxml="$OUT/junit_serial.xml" > "$OUT/pytest_serial.log" 2>&1
RC_SER=$?; echo "serial phase rc $RC_SER ($(elapsed))"; tail -n 3 "$OUT/pytest_serial.log"

# 3. summary: counts, failures, skip reasons, the slowest files (for the next split)
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import collections, os, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
total = collections.Counter(); per_file = collections.defaultdict(float); bad = []; skips = collections.Counter()
for phase in ("parallel", "serial"):
    path = f"{out}/junit_{phase}.xml"
    if not os.path.exists(path):
        print(f"{phase}: no junit file (the phase was cut short: see pytest_{phase}.log)")
        continue
    for case in ET.parse(path).iter("testcase"):
        f = case.get("classname", "").split(".")[1] if "." in case.get("classname", "") else case.get("classname")
        per_file[f] += float(case.get("time", 0))
        kind = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                kind = "failed"; bad.append(f"{case.get('classname')}::{case.get('name')}: {child.get('message', '')[:200]}")
            elif child.tag == "skipped":
                kind = "skipped"; skips[child.get("message", "")[:160]] += 1
        total[kind] += 1
print("tests:", ", ".join(f"{v} {k}" for k, v in sorted(total.items())))
for b in bad[:30]:
    print("  FAILED", b)
for msg, n in skips.most_common(12):
    print(f"  skipped x{n}: {msg}")
print("slowest files (s):", ", ".join(f"{f} {t:.0f}" for f, t in sorted(per_file.items(), key=lambda x: -x[1])[:12]))
PY
echo "done ($(elapsed))"
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv > "$OUT/smi.txt" 2>/dev/null || true
(( RC_PAR == 0 && RC_SER == 0 ))  # the exit status: 0 when both test phases passed
