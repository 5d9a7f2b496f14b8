#!/usr/bin/env bash
# Session 36, call 1 (builds made on the CPU machine with the device's torch, carried in .prebuilt/pack):
#  PF (next tile's S^T issued under this tile's dK, head_dim 64/128 bf16+fp16): the backward tests;
#  LN (two dQ accumulator copies for the head_dim <= 128 deterministic backward, 64/128 bf16): the deterministic tests
#     with the lanes tests parametrised over head_dim (the patch's test file, .prebuilt/pack/test_det_ln_gpu.py);
#  DE (staging buffer handed back before the writer's turn, 64/128 bf16): the deterministic tests;
#  then the A/B F vs PF (bwd, head_dim 64/128) and the deterministic A/B LN, LN lanes 2, DE, F.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for f in .prebuilt/pack/*.tar.xz; do python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" "$f"; done
T="tests/test_bwd_gpu.py tests/test_features_gpu.py tests/test_deterministic_gpu.py tests/test_varlen_gpu.py tests/test_head_dim_v_gpu.py tests/test_bwd_gqa_group_gpu.py tests/test_sections_gpu.py"
cp .prebuilt/pack/test_det_ln_gpu.py tests/test_det_ln_gpu.py
run_tests() {  # build timeout files...
  local b=$1 t=$2; shift 2
  rm -f flash_attn_hopper/_C*.so; cp -f .prebuilt/$b/_C.abi3.so flash_attn_hopper/_C.abi3.so
  echo "== tests on $b: $*"
  timeout $t python3 -m pytest -q -p no:cacheprovider --timeout 120 "$@" > $OUT/tests_$b.log 2>&1
  echo "rc $?"; tail -n 2 $OUT/tests_$b.log; grep -E "^FAILED" $OUT/tests_$b.log | head -20
}
[ "${SKIP_PF_TESTS:-0}" = 1 ] || run_tests PF ${PF_TIMEOUT:-170} $T
run_tests LN 60 tests/test_det_ln_gpu.py
run_tests DE 60 tests/test_deterministic_gpu.py
CASES="F;PF" DIRECTION=bwd ROUNDS=${ROUNDS:-3} TAG=pf BACKENDS=ours \
  BENCH="--head-dims 64,128 --causal both --features dense --seqlens 2048,4096,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-180} bash scripts/device_env_ab.sh
CASES="F;LN;LN FAH_BWD_DQ_LANES=2;DE" DIRECTION=bwd ROUNDS=2 TAG=det BACKENDS=ours \
  BENCH="--head-dims 128 --causal both --features deterministic --seqlens 4096,16384 --no-check --no-adjacent" \
  timeout ${DET_TIMEOUT:-110} bash scripts/device_env_ab.sh
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv > $OUT/smi.txt
