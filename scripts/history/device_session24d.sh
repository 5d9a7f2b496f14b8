#!/usr/bin/env bash
# Session 24: head_dim 64's 128-row tiles with four K/V stages (N4) and without ping-pong, against the head (W),
# forced to 128 rows, ROUNDS rounds in reversed order (ours only). Builds in .prebuilt/pack/p.tar.xz.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
CASES="W FAH_FWD_BLOCK_M=128;N4 FAH_FWD_BLOCK_M=128;W FAH_FWD_BLOCK_M=128 FAH_FWD_PINGPONG=0" ROUNDS=${ROUNDS:-2} \
  BENCH="--head-dims 64 --features dense --seqlens 1024,2048,4096 --no-check" TAG=n4 bash scripts/device_env_ab.sh
cp -f .prebuilt/N4/_C.abi3.so flash_attn_hopper/_C.abi3.so
FAH_FWD_BLOCK_M=128 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fwd_gpu.py tests/test_fwd_boundary_gpu.py \
  tests/test_varlen_gpu.py -k "not fp16" 2>&1 | tail -n 3 | tee $OUT/pytest_N4.log
