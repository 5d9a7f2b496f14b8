#!/usr/bin/env bash
# Session 65, call B (after the full GPU check of GA, 0061d2a's kernels): round 32's fixed-maximum case on the head's
# kernels (HEAD: 258d693, where the code predicts its failure) and on GA; then the forward A/B of the fix where it
# runs (bf16, softcap <= 30: the fixed maximum; the change is on the key blocks a mask crosses, so causal), in the
# order HEAD, GA, GA, HEAD; then the grid on GA (on an H200 the full grid with the feature points and fp16 dense; on
# another card the dense bf16 grid at 4096 and 16384).
#   carry [".prebuilt/pack/head.tar.xz", ".prebuilt/pack/ga.tar.xz"]; GRID_S / FP16_S: the grids' time limits;
#   GRID_S=0: no grid; GRID_FULL=0: the short grid on any card. Worst case of the limits: 550 s.
TAG=s65b source "$(dirname "$0")/device_packs.sh" head ga
FIXED=tests/test_bug_reports_thirtysecond_gpu.py::test_prefill_rows_equal_decode_and_chunks_fixed_max_softcap
use_pack HEAD; pytest_log ga_fixed_head "fixed max on HEAD" 60 "" "$FIXED"
use_pack GA; pytest_log ga_fixed_ga "fixed max on GA" 60 "" "$FIXED"
points() {
  use_pack $1; echo "== round $2: $1"
  timeout 40 python3 scripts/fwd_points.py 64,128,256 4096,16384 --causal yes --softcap 20 | grep -v "head_dim\|---"
  timeout 20 python3 scripts/fwd_points.py 128 4096,16384 --causal no --softcap 20 | grep -v "head_dim\|---"
}
points HEAD 1; points GA 1; points GA 2; points HEAD 2
use_pack GA
[[ ${GRID_S:-1} == 0 ]] && exit 0  # no grid
if [[ ${GRID_FULL:-1} == 1 ]] && grep -q H200 "$OUT/smi_s65b.txt"; then
  timeout ${GRID_S:-150} python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 --direction both \
    --features dense,gqa,varlen,window,softcap,deterministic --no-bar \
    --json "$OUT/grid_S65.json" --summary "$OUT/grid_S65_summary.md" > "$OUT/grid.log" 2>&1
  echo "grid rc $?"
  timeout ${FP16_S:-40} python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 --direction both --dtype fp16 \
    --features dense --no-bar --json "$OUT/grid_S65_fp16.json" --summary "$OUT/grid_S65_fp16_summary.md" \
    > "$OUT/grid_fp16.log" 2>&1
  echo "grid fp16 rc $?"
else
  timeout ${GRID_S:-100} python3 -m flash_attn_hopper.benchmark --seqlens 4096,16384 --direction both \
    --features dense --no-bar \
    --json "$OUT/grid_S65_h100.json" --summary "$OUT/grid_S65_h100_summary.md" > "$OUT/grid.log" 2>&1
  echo "grid rc $?"
fi
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$OUT/smi_s65b.txt"
