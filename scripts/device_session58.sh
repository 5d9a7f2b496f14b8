#!/usr/bin/env bash
# The next device session's first calls (prepared in session 57; CPU-compiled only): the deterministic head_dim 256
# backward's turn waits (13-15 % of its time under a causal mask on the H100, session 57's DX / DY probes).
# Candidates (head_dim 256 bf16 packs, scripts/build_pack.sh with REV=<branch> FAH_HDIMS=256 FAH_DTYPES=bf16):
#   DQE  (branch dqe): the consumers await the writer's DQEmpty with dV and dK issued, not before (also the default mode).
#   DT2  (branch dqturn2): a dQ turn per pass; pass 0's turn goes on before pass 1 is computed (deterministic only).
#   DET2 (branch det2): both.
# Baseline S56 (the head's C++). Predicted: deterministic causal +3-8 % (DET2 most), default mode level.
# PART=1 (~280 s): the deterministic and backward GPU tests on each candidate, then round 1 of the A/B.
# PART=2 (~200 s): round 2 in the reverse order.
#   carry [".prebuilt/pack/s56.tar.xz", ".prebuilt/pack/dqe.tar.xz", ".prebuilt/pack/dt2.tar.xz",
#          ".prebuilt/pack/det2.tar.xz"]; PART=1 OUT=$OUT bash scripts/device_session58.sh, then PART=2
# Missing packs: NAME=S56 bash scripts/build_pack.sh (full, ~9 min), then for each candidate e.g.
#   REV=det2 NAME=DET2 FAH_HDIMS=256 FAH_DTYPES=bf16 bash scripts/build_pack.sh (~3 min).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/s58}; mkdir -p "$OUT"
for p in s56 dqe dt2 det2; do
  python3 -c "import tarfile; tarfile.open('.prebuilt/pack/$p.tar.xz').extractall('.prebuilt')" || exit 1
done
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv | tee "$OUT/smi.txt"
points() {  # one build's points: deterministic causal and not, default causal (DQE changes the default mode too)
  cp -f .prebuilt/$1/_C.abi3.so flash_attn_hopper/_C.abi3.so
  echo "== round $2: $1"
  GQA_DETERMINISTIC=1 GQA_CAUSAL=yes timeout 40 python3 scripts/gqa_bwd_points.py 4096,16384 16 256 | grep -v "^#"
  GQA_DETERMINISTIC=1 GQA_CAUSAL=no timeout 40 python3 scripts/gqa_bwd_points.py 4096 16 256 | grep -v "^#" \
    | sed 's/$/ deterministic/'
  GQA_CAUSAL=yes timeout 40 python3 scripts/gqa_bwd_points.py 4096,16384 16 256 | grep -v "^#" | sed 's/$/ default/'
}
if [[ ${PART:-1} == 1 ]]; then
  for b in DQE DT2 DET2; do
    cp -f .prebuilt/$b/_C.abi3.so flash_attn_hopper/_C.abi3.so
    timeout 60 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_deterministic_gpu.py tests/test_bwd_gpu.py \
      > "$OUT/tests_$b.log" 2>&1
    echo "$b tests rc $?: $(tail -n 1 "$OUT/tests_$b.log")"; grep -m 10 "^FAILED" "$OUT/tests_$b.log"
  done
  for b in S56 DQE DT2 DET2; do points $b 1; done 2>&1 | tee "$OUT/det_ab_round1.txt"
else
  for b in DET2 DT2 DQE S56; do points $b 2; done 2>&1 | tee "$OUT/det_ab_round2.txt"
fi
