#!/usr/bin/env bash
# Issue 4 (development, ~4 min): a head_dim 64 bf16 build, then scripts/profile_train.py (train_lm's step, per-kernel
# GPU time per backend and the difference) with the forward's tile height as chosen and forced to 128 and 192.
set -u
export PYTHONPATH=$PWD
OUT_FINAL=$OUT
source scripts/device_dev_build.sh
for m in chosen 128 192; do
  if [[ $m == chosen ]]; then unset FAH_FWD_BLOCK_M; else export FAH_FWD_BLOCK_M=$m; fi
  timeout 150 python3 scripts/profile_train.py --steps 5 > $OUT_FINAL/profile_$m.log 2>&1
  echo "== fwd block_m $m rc $?"; grep -E "^== |^ +[+-]" $OUT_FINAL/profile_$m.log | head -n 14
done
