#!/usr/bin/env bash
# Session 35, call 1: the backward GPU tests on DQ (session 34's head_dim 64 dQ row split, head_dim 64 bf16 build) and
# DQDS (row split + dS stored before the dV GEMM, head_dim 64/128 bf16), both made on the CPU machine with the device's
# torch and carried in .prebuilt/pack; then the head_dim 64 backward A/B (HEAD, DQ, DQDS), 3 rounds.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for f in .prebuilt/pack/*.tar.xz; do python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" "$f"; done
T="tests/test_bwd_gpu.py tests/test_features_gpu.py tests/test_deterministic_gpu.py tests/test_varlen_gpu.py tests/test_head_dim_v_gpu.py tests/test_bwd_gqa_group_gpu.py tests/test_sections_gpu.py"
for b in ${TEST_BUILDS:-DQDS DQ}; do
  rm -f flash_attn_hopper/_C*.so; cp -f .prebuilt/$b/_C.abi3.so flash_attn_hopper/_C.abi3.so
  echo "== tests on $b"
  timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider --timeout 120 $T > $OUT/tests_$b.log 2>&1
  echo "rc $?"; tail -n 4 $OUT/tests_$b.log; grep -E "^FAILED" $OUT/tests_$b.log | head -20
done
CASES="${AB_CASES:-HEAD;DQ;DQDS}" DIRECTION=bwd ROUNDS=${ROUNDS:-3} TAG=${TAG:-hd64} BACKENDS=ours \
  BENCH="--head-dims ${AB_HD:-64} --causal both --features dense --seqlens ${AB_SEQ:-2048,4096,16384} --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-330} bash scripts/device_env_ab.sh
