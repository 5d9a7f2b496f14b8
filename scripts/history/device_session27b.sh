#!/usr/bin/env bash
# Session 27 call 2 (prebuilt FINAL, as call 1): (1) scripts/window_gap.py, window against dense of the same useful
# work in one process, dense and softcap 30, twice; (2) Nsight Compute of the head_dim 64 forward at 16384, causal
# against non-causal (call 1: 479-483 against 516-528 TFLOP/s), and of head_dim 128 causal (585-622).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
cp -f .prebuilt/FINAL/_C.abi3.so flash_attn_hopper/_C.abi3.so
for r in 1 2; do
  timeout 120 python3 scripts/window_gap.py 2>&1 | tee -a $OUT/window_gap.txt
  timeout 120 python3 scripts/window_gap.py 30 2>&1 | tee -a $OUT/window_gap_softcap.txt
done
CASES="64 16384 dense causal;64 16384 dense;128 16384 dense causal" TAG=hd64causal timeout 400 bash scripts/ncu_fwd.sh
