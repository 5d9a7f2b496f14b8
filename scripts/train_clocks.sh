#!/usr/bin/env bash
# Issue 4 diagnostic (development): does one backend run the training loop at lower SM clocks or higher power? Trains
# examples/train_lm.py once per backend per round (order reversed every other round, ROUNDS rounds, default 2) with
# nvidia-smi sampling SM clock, power and temperature every 100 ms, and prints per run: tokens/s, mean and 10th
# percentile SM clock, mean power, max temperature. Needs nvidia-smi and the built extension (PYTHONPATH=repo root).
set -u
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-300}
OUTDIR=${OUT:-/tmp}/train_clocks
mkdir -p "$OUTDIR"
order=(flash_attn_hopper sdpa)
printf '| run | backend | tokens/s | SM MHz mean | SM MHz p10 | power W mean | temp C max |\n|---|---|---|---|---|---|---|\n'
run=0
for ((r = 0; r < ROUNDS; r++)); do
  if (( r % 2 == 1 )); then backends=("${order[1]}" "${order[0]}"); else backends=("${order[@]}"); fi
  for b in "${backends[@]}"; do
    run=$((run + 1))
    log=$OUTDIR/smi_$run.csv
    nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 100 > "$log" &
    smi=$!
    PYTHONPATH=${PYTHONPATH:-$PWD} python3 examples/train_lm.py --backends "$b" --steps "$STEPS" \
      --json "$OUTDIR/train_$run.json" > "$OUTDIR/train_$run.log" 2>&1
    kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
    python3 - "$log" "$OUTDIR/train_$run.json" "$run" "$b" <<'PY'
import json, statistics, sys
log, record, run, backend = sys.argv[1:]
rows = []
for line in open(log):
    try:
        rows.append([float(x) for x in line.split(",")])
    except ValueError:
        pass
rows = rows[len(rows) // 10:]  # the first tenth: model build and warm-up
clocks = sorted(r[0] for r in rows) or [float("nan")]
tps = json.load(open(record))["results"][0]["tokens_per_s"]
print(f"| {run} | {backend} | {tps:,.0f} | {statistics.mean(clocks):.0f} | {clocks[len(clocks) // 10]:.0f} | "
      f"{statistics.mean(r[1] for r in rows):.0f} | {max(r[2] for r in rows):.0f} |")
PY
  done
done
