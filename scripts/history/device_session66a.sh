#!/usr/bin/env bash
# Session 66, after the GPU check (GA's kernels, then EX's: 73e371d, the exact pass's per-row choice): the dense
# forward of GA and EX in the order GA, EX, EX, GA (the change only moves the exact pass's thresholds, so level is
# the prediction), then the feature grid on EX at 4096 and 16384 (bf16: dense, GQA, varlen, window, softcap,
# deterministic) and fp16 dense beside it.
#   carry [".prebuilt/pack/ga.tar.xz", ".prebuilt/pack/ex.tar.xz"]; GRID_S / FP16_S: the grids' limits (worst 330 s).
TAG=s66a source "$(dirname "$0")/device_packs.sh" ga ex
points() {
  use_pack $1; echo "== round $2: $1"
  timeout 40 python3 scripts/fwd_points.py 64,128,256 4096,16384 --causal no | grep -v "head_dim\|---"
}
points GA 1; points EX 1; points EX 2; points GA 2
use_pack EX
timeout ${GRID_S:-170} python3 -m flash_attn_hopper.benchmark --seqlens 4096,16384 --direction both \
  --features dense,gqa,varlen,window,softcap,deterministic --no-bar \
  --json "$OUT/grid_S66.json" --summary "$OUT/grid_S66_summary.md" > "$OUT/grid.log" 2>&1
echo "grid rc $?"
timeout ${FP16_S:-40} python3 -m flash_attn_hopper.benchmark --seqlens 4096,16384 --direction both --dtype fp16 \
  --features dense --no-bar --json "$OUT/grid_S66_fp16.json" --summary "$OUT/grid_S66_fp16_summary.md" \
  > "$OUT/grid_fp16.log" 2>&1
echo "grid fp16 rc $?"
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$OUT/smi_s66a.txt"
