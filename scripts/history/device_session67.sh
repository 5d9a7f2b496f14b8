#!/usr/bin/env bash
# Session 67's last device call, on pack NAT (b9b1fc8's kernels: the exact pass in natural units): the SASS / HGMMA
# check, the four files that exercise the exact pass, the two test_bwd_gqa_group_gpu.py tests call 1's budget cut,
# then the grid (bf16 with the feature points, and fp16 dense) at 1024, 4096 and 16384. Worst case ~540 s.
#   carry [".prebuilt/pack/nat.tar.xz", ".whl"]; OUT as the device gives it.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/s67}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "+$(( $(date +%s) - T0 ))s"; }
PREBUILT=NAT PACK=nat PHASES=none BUDGET=330 OUT="$OUT/check" bash scripts/device_check_parallel.sh \
  > "$OUT/check.txt" 2>&1
echo "sass $(el): $(grep -m1 'HGMMA check' "$OUT/check.txt");" \
  "$(grep -m1 -o 'spills: [0-9]* kernel(s) spill' "$OUT/check.txt")"
export FAH_PREBUILT=1 FAH_BUILD_LOG=$PWD/.prebuilt/NAT/build.log
timeout -s INT -k 10 170 python3 -m pytest -q -rs -p no:cacheprovider -n 4 --dist loadfile \
  tests/test_bug_reports_thirtysecond_gpu.py tests/test_bug_reports_thirtyfirst_gpu.py \
  tests/test_bug_reports_fifth_gpu.py tests/test_kernel_edges_twelfth_gpu.py --junitxml="$OUT/j_exact.xml" \
  > "$OUT/exact.log" 2>&1
echo "exact-pass files rc $? $(el): $(tail -n 1 "$OUT/exact.log")"; grep -E "^FAILED" "$OUT/exact.log" | head -20
timeout -s INT -k 10 110 python3 -m pytest -q -rs -p no:cacheprovider -n 1 tests/test_bwd_gqa_group_gpu.py \
  --junitxml="$OUT/j_gqa.xml" > "$OUT/gqa.log" 2>&1
echo "bwd_gqa_group rc $? $(el): $(tail -n 1 "$OUT/gqa.log")"
timeout 150 python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 --direction both \
  --features dense,gqa,varlen,window,softcap,deterministic --no-bar \
  --json "$OUT/grid_S67.json" --summary "$OUT/grid_S67_summary.md" > "$OUT/grid.log" 2>&1
echo "grid rc $? $(el)"
timeout 50 python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 --direction both --dtype fp16 \
  --features dense --no-bar --json "$OUT/grid_S67_fp16.json" --summary "$OUT/grid_S67_fp16_summary.md" \
  > "$OUT/grid_fp16.log" 2>&1
echo "grid fp16 rc $? $(el)"
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv > "$OUT/smi.txt" 2>/dev/null
