#!/usr/bin/env bash
# Session 25, second call on the warm machine that built the tree (scripts/device_session25c.sh): the two test files
# left out of the first call; then GRID=1: the full grid (ours, cuDNN, FA2) with the feature points; or GRID=0: the
# causal backward A/B at head_dim 128 (the chosen 64 rows against 80 forced) and the forward A/B at head_dim 64 of the
# tree (128-row tiles without ping-pong) against session 24's head (W, from .prebuilt/pack/p.tar.xz).
set -u
export PYTHONUNBUFFERED=1
so=$(compgen -G "flash_attn_hopper/_C*.so" | head -n 1)
[ -n "$so" ] || exit 1
timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider tests/test_varlen_gpu.py tests/test_bwd_tiles_gpu.py \
  2>&1 | tail -n 6 | tee $OUT/pytest_rest.log
if [[ ${GRID:-1} == 1 ]]; then
  FAH_PREBUILT=1 FAH_SKIP_TESTS=1 timeout 250 bash scripts/gpu_check.sh > $OUT/grid.out 2>&1
  cp .fah_build/gpu_check/{bench_attention.json,bench_extra.tar.gz,summary.txt} $OUT/
  tail -n 5 $OUT/grid.out
else
  mkdir -p .prebuilt/TREE && cp -f "$so" .prebuilt/TREE/_C.abi3.so
  python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
  CASES="TREE;TREE FAH_BWD_BLOCK_M=80" DIRECTION=bwd ROUNDS=${ROUNDS:-2} TAG=bwd80c BACKENDS=ours \
    BENCH="--head-dims 128 --features dense --seqlens 1024,4096,16384 --causal yes --no-check" \
    bash scripts/device_env_ab.sh
  BUILDS="W TREE" ROUNDS=${ROUNDS:-2} TAG=np \
    BENCH="--head-dims 64 --features dense --seqlens 512,1024,2048,4096 --causal yes --no-check;--head-dims 64 --features dense --seqlens 512,1024 --causal no --no-check" \
    bash scripts/device_ab_prebuilt.sh
  cp -f .prebuilt/TREE/_C.abi3.so "$so"
fi
