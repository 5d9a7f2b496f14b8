#!/usr/bin/env bash
# head_dim 64 forward with each tile height forced (FAH_FWD_BLOCK_M=128 / 192, read once per process) on a prebuilt
# extension (.prebuilt/$BUILD), dense bf16, both causal settings, ROUNDS rounds: the data behind kFwd64WideCost* in
# csrc/flash/config.hpp. JSONs into $OUT/block_m_sweep_$BUILD.tar.gz, the table lines on stdout.
set -u
export PYTHONUNBUFFERED=1
cp -f .prebuilt/${BUILD:-E}/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
D=/tmp/bm_sweep; mkdir -p $D
for r in $(seq 1 ${ROUNDS:-1}); do
  for bm in 128 192; do
    echo "== round $r FAH_FWD_BLOCK_M=$bm"
    FAH_FWD_BLOCK_M=$bm timeout 200 python3 -m flash_attn_hopper.benchmark --head-dims 64 --features dense \
      --seqlens ${SEQLENS:-512,1024,2048,4096,8192,16384} --direction fwd --backends ours --no-bar \
      --json $D/bm${bm}_r$r.json 2>&1 | grep "^| " | cut -d'|' -f2-6
  done
done
tar czf $OUT/block_m_sweep_${BUILD:-E}.tar.gz -C /tmp bm_sweep
