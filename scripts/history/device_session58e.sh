#!/usr/bin/env bash
# Prepared in session 58, not run (too little device time was left). Timing probes with wrong results: how much
# of the head_dim 256 backward's time is the dQ traffic. Each tile's writer sends 64 KB of fp32 dQ as TMA
# reduce-adds into L2 (64 x 256 floats per 64 x 64 tile, ~3.4 us of GEMMs per tile at ~410 TFLOP/s: ~19 GB/s per
# SM, ~2.5 TB/s over 132 SMs).
#   DQST: the same traffic as plain TMA stores (dq_store_probe_TIMING_ONLY.patch): the reduction's own cost.
#   DQNO: no dQ leaves shared memory (dq_none_probe_TIMING_ONLY.patch): the traffic's whole cost.
# Against DQEF (the head). If DQNO is far above DQEF (> 5 %), the dQ path bounds the kernel.
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/dqst.tar.xz", ".prebuilt/pack/dqno.tar.xz"]
# Packs (scripts/build_pack.sh): NAME=DQEF (the head, full; or FAH_HDIMS=256 FAH_DTYPES=bf16), and with
#   R=benchmarks/results/2026-12-06_session58: NAME=DQST PATCHES=$R/dq_store_probe_TIMING_ONLY.patch FAH_HDIMS=256
#   FAH_DTYPES=bf16; NAME=DQNO the same with PATCHES=$R/dq_none_probe_TIMING_ONLY.patch (~3 min each here).
TAG=s58e source "$(dirname "$0")/device_packs.sh" dqef dqst dqno
# First the twenty-seventh bug-report round (never run on a GPU) on the head's kernels (DQEF is a full build).
use_pack DQEF
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_bug_reports_twentyseventh_gpu.py \
  > "$OUT/round27.log" 2>&1
echo "round 27 rc $?: $(tail -n 1 "$OUT/round27.log")"
grep -m 10 "^FAILED" "$OUT/round27.log"
for b in DQEF DQST DQNO; do
  use_pack $b; echo "== $b"
  for c in yes no; do GQA_CAUSAL=$c timeout 30 python3 scripts/gqa_bwd_points.py 4096,16384 16 256 | grep -v "^#"; done
  GQA_DETERMINISTIC=1 GQA_CAUSAL=yes timeout 30 python3 scripts/gqa_bwd_points.py 4096,16384 16 256 | grep -v "^#" \
    | sed 's/$/ deterministic/'
done 2>&1 | tee "$OUT/dq_traffic_probe.txt"
