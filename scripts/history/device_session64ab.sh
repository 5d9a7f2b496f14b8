#!/usr/bin/env bash
# Session 64, calls 1 and 2: a candidate that normalises O by the row sums of the rounded P taken on the tensor cores
# (RSTC: m64n8k16 WGMMAs of P times ones in P V's commit group; HM: mma.sync of P times ones at P's conversion; full
# builds of benchmarks/results/2026-12-07_session64/fwd_rowsum_{wgmma,mma_sync}_LOST.patch made on the CPU machine)
# against DQEF (session 63's head kernels, full build). Round 31 on the candidate (its marks were removed in the tree
# at the time, so all 42 had to pass; on a tree with FX's strict marks a candidate that fixes FX fails them as XPASS,
# the signal), then forward TFLOP/s in the order DQEF, candidate, candidate, DQEF: bf16 at head_dim 64/128/256, softcap
# 30 at 128, fp16 at 64/128. Calls 1 and 2 ran it as device_session64a.sh / 64b.sh (card records smi_s64a / s64b.txt).
#   bash scripts/history/device_session64ab.sh RSTC   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/rstc.tar.xz", ".whl"]
CAND=$1 stem=$(echo "$1" | tr 'A-Z' 'a-z')
TAG=s64_$stem source "$(dirname "$0")/device_packs.sh" dqef "$stem"
use_pack "$CAND"
pytest_log "round31_$stem" round31 ${T_S:-90} 8 -rxX tests/test_bug_reports_thirtyfirst_gpu.py
points() {
  use_pack $1; echo "== round $2: $1"
  timeout 60 python3 scripts/fwd_points.py 64,128,256 4096,16384 | grep -v "head_dim\|---"
  timeout 30 python3 scripts/fwd_points.py 128 4096,16384 --causal no --softcap 30 | grep -v "head_dim\|---"
  timeout 30 python3 scripts/fwd_points.py 64,128 16384 --dtype fp16 | grep -v "head_dim\|---" | sed 's/$/ fp16/'
}
points DQEF 1; points "$CAND" 1; points "$CAND" 2; points DQEF 2
