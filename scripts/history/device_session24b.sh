#!/usr/bin/env bash
# Session 24, second call on the warm machine that built the tree (scripts/history/device_run4.sh): the test file left out
# of the first call, the full grid (ours, cuDNN, FA2) with the feature points, an fp16 forward/backward slice, then
# head_dim 64's 128-row tiles with four K/V stages (.prebuilt/N4, from .prebuilt/pack/p.tar.xz) and without ping-pong
# against the tree's build, and Nsight Compute of the head_dim 128 backward.
# In session 24's call 3 the A/B step did not run: `cp` found no .prebuilt/HEAD/_C.abi3.so although the lines above
# create it (cause not found), so device_env_ab.sh stopped at its first case; the rest of the call ran. The same A/B
# ran in call 5 from builds carried in the pack (scripts/history/device_session24d.sh).
set -u
export PYTHONUNBUFFERED=1
ls flash_attn_hopper/_C*.so || exit 1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_varlen_gpu.py 2>&1 | tail -n 4 | tee $OUT/pytest_varlen.log
FAH_PREBUILT=1 FAH_SKIP_TESTS=1 timeout 280 bash scripts/gpu_check.sh > $OUT/grid.out 2>&1
cp .fah_build/gpu_check/{bench_attention.json,bench_extra.tar.gz,summary.txt} $OUT/
tail -n 5 $OUT/grid.out
timeout 90 python3 -m flash_attn_hopper.benchmark --dtype fp16 --head-dims 64,128,256 --seqlens 4096,16384 --causal no \
  --direction both --backends ours,cudnn --no-bar --no-check --json $OUT/fp16.json 2>&1 | grep "^| " | cut -d'|' -f2-12
cp -f flash_attn_hopper/_C.abi3.so /tmp/head_C.abi3.so
mkdir -p .prebuilt/HEAD && cp /tmp/head_C.abi3.so .prebuilt/HEAD/
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
CASES="HEAD FAH_FWD_BLOCK_M=128;N4 FAH_FWD_BLOCK_M=128;HEAD FAH_FWD_BLOCK_M=128 FAH_FWD_PINGPONG=0" ROUNDS=2 \
  BENCH="--head-dims 64 --features dense --seqlens 1024,4096 --no-check" TAG=n4 bash scripts/device_env_ab.sh
cp -f /tmp/head_C.abi3.so flash_attn_hopper/_C.abi3.so
NCU_TIMEOUT=100 CASES="128 16384 dense bwd" KERNEL=flash_bwd_sm90_kernel TAG=bwd128 timeout 110 bash scripts/ncu_fwd.sh
