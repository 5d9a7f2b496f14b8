#!/usr/bin/env bash
# Session 18's final device call (~9 minutes): the GPU check from a clean build without the grid (scripts/history/device_run4.sh
# with FAH_SKIP_BENCH=1), then the forward at head_dim 128 and 64, dense and softcap 30, ours and cuDNN in one process
# per head dim (the softcap change's cost against dense of the same build); JSONs in $OUT.
set -u
FAH_SKIP_BENCH=1 CHECK_TIMEOUT=${CHECK_TIMEOUT:-480} bash scripts/history/device_run4.sh
for h in 128 64; do
  timeout 90 python3 -m flash_attn_hopper.benchmark --head-dims $h --features dense,softcap --seqlens 1024,4096,16384 \
    --direction fwd --backends ours,cudnn --no-check --no-bar --json $OUT/fwd_softcap_hdim$h.json 2>&1 \
    | grep "^| " | cut -d'|' -f2-9
done
