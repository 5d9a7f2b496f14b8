#!/usr/bin/env bash
# Session 65, call A, on the head's kernels (pack head: 258d693 built on the CPU machine): round 31's GPU file (its
# exact-pass fp16 case had never run on a GPU) and round 32's (GA's fixed-maximum case predicted to fail here), then
# the benchmark grid (bf16 with the feature points, fp16 dense) when the card is an H200; on another card only the
# dense bf16 grid at 4096 and 16384.
#   carry [".prebuilt/pack/head.tar.xz"]
TAG=s65a source "$(dirname "$0")/device_packs.sh" head
use_pack HEAD
pytest_log round31 "round 31" 120 4 tests/test_bug_reports_thirtyfirst_gpu.py --junitxml="$OUT/round31.xml"
pytest_log round32 "round 32" 150 4 tests/test_bug_reports_thirtysecond_gpu.py --junitxml="$OUT/round32.xml"
if grep -q H200 "$OUT/smi_s65a.txt"; then
  timeout 200 python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 --direction both \
    --features dense,gqa,varlen,window,softcap,deterministic --no-bar \
    --json "$OUT/grid_S65.json" --summary "$OUT/grid_S65_summary.md" > "$OUT/grid.log" 2>&1
  echo "grid rc $?"
  timeout 80 python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 --direction both --dtype fp16 \
    --features dense --no-bar --json "$OUT/grid_S65_fp16.json" --summary "$OUT/grid_S65_fp16_summary.md" \
    > "$OUT/grid_fp16.log" 2>&1
  echo "grid fp16 rc $?"
else
  timeout 120 python3 -m flash_attn_hopper.benchmark --seqlens 4096,16384 --direction both --features dense --no-bar \
    --json "$OUT/grid_S65_h100.json" --summary "$OUT/grid_S65_h100_summary.md" > "$OUT/grid.log" 2>&1
  echo "grid rc $?"
fi
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$OUT/smi_s65a.txt"
