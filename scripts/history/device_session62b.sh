#!/usr/bin/env bash
# Session 62, call 2: a timing probe, not a candidate. HALFKV (results/2026-12-06_session62/fwd_half_kv_PROBE.patch,
# wrong results on purpose) skips every other key block's K and V load from a tile's third block on, halving the
# forward's L2-to-SM K/V traffic as a 2-CTA cluster with TMA multicast would (FlashAttention-3 clusters its non-causal
# forward at head_dim >= 128). Its gain bounds what multicast could give; if it is small, that lead is closed.
# Pack: REV=HEAD NAME=HALFKV PATCHES=<the patch> FAH_HDIMS=128,256 FAH_DTYPES=bf16 bash scripts/build_pack.sh.
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/halfkv.tar.xz"]
TAG=s62b source "$(dirname "$0")/device_packs.sh" dqef halfkv
{ for r in "DQEF 1" "HALFKV 1" "HALFKV 2" "DQEF 2"; do
    set -- $r; use_pack $1; echo "== round $2: $1"
    timeout 60 python3 scripts/fwd_points.py 128,256 4096,16384 --causal both | grep -v "^| head_dim"
  done; } 2>&1 | tee "$OUT/halfkv_ab.txt"
