#!/usr/bin/env bash
# Session 24, one device call: head_dim 128's 176-key blocks against 128 (FAH_FWD_BLOCK_N, one build, ours and cuDNN
# per process), head_dim 64's 128-row tiles with the split loop (NS) or the reduction chains (NC) against neither (W),
# then the tile tests on W. Builds from the CPU machine in .prebuilt/pack/p.tar.xz.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader
CASES="W FAH_FWD_BLOCK_N=128;W FAH_FWD_BLOCK_N=176" BACKENDS=ours,cudnn ROUNDS=${ROUNDS_N:-2} \
  BENCH="--head-dims 128 --features dense --causal no --seqlens 1024,2048,4096,8192,16384 --no-check" \
  TAG=n176 bash scripts/device_env_ab.sh
CASES="W FAH_FWD_BLOCK_M=128;NS FAH_FWD_BLOCK_M=128;NC FAH_FWD_BLOCK_M=128" ROUNDS=2 \
  BENCH="--head-dims 64 --features dense --seqlens 1024,4096 --no-check" TAG=narrow bash scripts/device_env_ab.sh
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader
cp -f .prebuilt/W/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/test_fwd_tiles_gpu.py tests/test_tile_choice_cpu.py \
  tests/test_fwd_gpu.py -k "bf16 or not fp16" 2>&1 | tail -n 15 | tee $OUT/pytest_W.log
