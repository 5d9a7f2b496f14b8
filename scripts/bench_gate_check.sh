#!/usr/bin/env bash
# Checks the nightly benchmark end to end on a GPU machine (issue 8), with the extension already built:
#   1. the whole default grid (shared/baselines.md plus feature points), timed, with plots and the summary;
#   2. the same grid again with --compare against run 1: must pass (exit 0);
#   3. one point compared against a copy of run 1 doctored 10 % faster (every ours TFLOP/s x 1.1): must fail
#      (exit 1) and name the point.
# Results go to $OUT (default .fah_build/gate) as gate.tar.gz plus gate_summary.txt. Exit 0 when all three behave.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/.fah_build/gate}
W=$ROOT/.fah_build/gate_work
rm -rf "$W" && mkdir -p "$W" "$OUT"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
ok=1

t0=$(date +%s)
"$PY" -m flash_attn_hopper.benchmark --no-bar --json "$W/run1.json" --plots "$W/plots" --summary "$W/summary.md" \
  > "$W/run1.log" 2>&1
rc1=$?
t1=$(date +%s)
echo "run 1 (whole grid): exit $rc1, $((t1 - t0)) s wall" | tee "$W/gate_summary.txt"
[[ $rc1 -eq 0 ]] || ok=0

"$PY" -m flash_attn_hopper.benchmark --no-bar --json "$W/run2.json" --compare "$W/run1.json" > "$W/run2.log" 2>&1
rc2=$?
t2=$(date +%s)
echo "run 2 (whole grid, --compare run 1): exit $rc2 (want 0), $((t2 - t1)) s wall" | tee -a "$W/gate_summary.txt"
[[ $rc2 -eq 0 ]] || ok=0

"$PY" - "$W/run1.json" "$W/doctored.json" <<'EOF'
import json, sys
rec = json.load(open(sys.argv[1]))
for point in rec["results"]:
    for direction in ("fwd", "bwd"):
        d = point.get(direction) or {}
        if d.get("tflops", {}).get("ours"):
            d["tflops"]["ours"] *= 1.1
            d["ms"]["ours"] /= 1.1
json.dump(rec, open(sys.argv[2], "w"), indent=1)
EOF
"$PY" -m flash_attn_hopper.benchmark --no-bar --head-dims 128 --seqlens 4096 --causal no --features dense \
  --json "$W/run3.json" --compare "$W/doctored.json" > "$W/run3.log" 2>&1
rc3=$?
echo "run 3 (one point vs a baseline doctored 10 % faster): exit $rc3 (want 1)" | tee -a "$W/gate_summary.txt"
[[ $rc3 -eq 1 ]] || ok=0

{
  echo; echo "--- run 1 tail"; tail -n 60 "$W/run1.log"
  echo; echo "--- run 2 tail"; tail -n 25 "$W/run2.log"
  echo; echo "--- run 3 tail"; tail -n 25 "$W/run3.log"
} >> "$W/gate_summary.txt"
cp "$W/gate_summary.txt" "$OUT/"
tar -czf "$OUT/gate.tar.gz" -C "$W" .
echo "gate check: $([[ $ok -eq 1 ]] && echo PASS || echo FAIL)"
[[ $ok -eq 1 ]]
