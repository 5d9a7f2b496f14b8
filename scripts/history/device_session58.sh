#!/usr/bin/env bash
# Session 58's first calls (prepared in session 57; ran in session 58: DQE won and landed, DT2 and DET2 lost):
# the deterministic head_dim 256 backward's turn waits (13-15 % of its time under a causal mask on the H100,
# session 57's DX / DY probes).
# Candidates (head_dim 256 bf16 packs; the patches are in benchmarks/results/2026-12-06_session57/):
#   DQE  (dqe_UNRUN.patch): the consumers await the writer's DQEmpty with dV and dK issued, not before (the default
#        mode too).
#   DT2  (dqturn2_UNRUN.patch): a dQ turn per pass; pass 0's turn goes on before pass 1 is computed (deterministic).
#   DET2 (both patches, in that order).
# Baseline S56 (the head's C++). Predicted: deterministic causal +3-8 % (DET2 most), default mode level.
# PART=1 (~280 s): the deterministic and backward GPU tests on each candidate, then round 1 of the A/B.
# PART=2 (~230 s): round 2 in the reverse order, then DET2's turn waits traced (DET2T: det2_trace_UNRUN.patch, the
#   trace probe on DET2; one wait slot per tile sums both passes' waits), head_dim 256 causal 4096 and 16384, to set
#   beside session 57's trace of the head (det_trace.txt).
# PART=3 (~60 s): the turn waits traced (TRACE pack: bwd_trace_probe_UNRUN.patch on the head; scripts/bwd_trace.py),
#   head_dim 256 causal 4096 and 16384, non-causal 4096 (ran in session 57: det_trace.txt; PART=3 reads only trace).
#   carry [".prebuilt/pack/s56.tar.xz", ".prebuilt/pack/dqe.tar.xz", ".prebuilt/pack/dt2.tar.xz",
#          ".prebuilt/pack/det2.tar.xz", ".prebuilt/pack/det2t.tar.xz"]; PART=1 OUT=$OUT bash
#   scripts/history/device_session58.sh, then PART=2
# Missing packs: NAME=S56 bash scripts/build_pack.sh (full, ~9 min), then for each candidate (~3 min each), e.g.
#   R=benchmarks/results/2026-12-06_session57; NAME=DET2 PATCHES="$R/dqe_UNRUN.patch $R/dqturn2_UNRUN.patch" \
#   FAH_HDIMS=256 FAH_DTYPES=bf16 bash scripts/build_pack.sh; the same with NAME=DET2T
#   PATCHES=$R/det2_trace_UNRUN.patch (all three changes in one patch), and NAME=TRACE
#   PATCHES=$R/bwd_trace_probe_UNRUN.patch for PART=3.
if [[ ${PART:-1} == 3 ]]; then
  TAG=s58 source "$(dirname "$0")/device_packs.sh" trace
  use_pack TRACE
  for c in "4096 causal" "16384 causal" "4096 full"; do timeout 60 python3 scripts/bwd_trace.py 256 $c; done \
    2>&1 | tee "$OUT/det_trace.txt"
  exit 0
fi
TAG=s58 source "$(dirname "$0")/device_packs.sh" s56 dqe dt2 det2 $([[ ${PART:-1} == 2 ]] && echo det2t)
points() {  # one build's points: deterministic causal and not, default causal (DQE changes the default mode too)
  use_pack $1
  echo "== round $2: $1"
  GQA_DETERMINISTIC=1 GQA_CAUSAL=yes timeout 40 python3 scripts/gqa_bwd_points.py 4096,16384 16 256 | grep -v "^#"
  GQA_DETERMINISTIC=1 GQA_CAUSAL=no timeout 40 python3 scripts/gqa_bwd_points.py 4096 16 256 | grep -v "^#" \
    | sed 's/$/ deterministic/'
  GQA_CAUSAL=yes timeout 40 python3 scripts/gqa_bwd_points.py 4096,16384 16 256 | grep -v "^#" | sed 's/$/ default/'
}
if [[ ${PART:-1} == 1 ]]; then
  for b in DQE DT2 DET2; do
    use_pack $b
    timeout 60 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_deterministic_gpu.py tests/test_bwd_gpu.py \
      > "$OUT/tests_$b.log" 2>&1
    echo "$b tests rc $?: $(tail -n 1 "$OUT/tests_$b.log")"; grep -m 10 "^FAILED" "$OUT/tests_$b.log"
  done
  for b in S56 DQE DT2 DET2; do points $b 1; done 2>&1 | tee "$OUT/det_ab_round1.txt"
else
  for b in DET2 DT2 DQE S56; do points $b 2; done 2>&1 | tee "$OUT/det_ab_round2.txt"
  use_pack DET2T
  for c in "4096 causal" "16384 causal"; do timeout 60 python3 scripts/bwd_trace.py 256 $c; done \
    2>&1 | tee "$OUT/det2_trace.txt"
fi
