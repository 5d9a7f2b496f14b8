#!/usr/bin/env bash
# Session 42: head_dim 128's softcap forward on 64-key blocks (build SC64, head_dim 128 bf16, carried in
# .prebuilt/pack/sc64.tar.xz; FAH_FWD_SOFTCAP_BLOCK_N=64 selects them; patch in
# results/2026-12-04_h200_session42/fwd_hdim128_softcap_64key_blocks_NOT_KEPT.patch). First the timing beside the
# 128-key blocks of the same build (with the benchmark's reference check), then the softcap tests on the 64-key blocks.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" .prebuilt/pack/sc64.tar.xz || exit 1
CASES="SC64 FAH_FWD_SOFTCAP_BLOCK_N=64;SC64" DIRECTION=fwd ROUNDS=${ROUNDS:-2} TAG=sc64 BACKENDS=ours BENCH_TIMEOUT=60 \
  BENCH="--head-dims 128 --causal both --features softcap --seqlens ${SEQLENS:-4096,16384} --no-adjacent" \
  timeout ${AB_TIMEOUT:-130} bash scripts/device_env_ab.sh | tee $OUT/ab_sc64.txt
cp -f .prebuilt/SC64/_C.abi3.so flash_attn_hopper/_C.abi3.so
FAH_FWD_SOFTCAP_BLOCK_N=64 timeout ${TEST_TIMEOUT:-70} python3 -m pytest -q -p no:cacheprovider --timeout 60 \
  tests/test_features_gpu.py tests/test_softcap_accuracy_gpu.py -k softcap > $OUT/pytest_sc64.log 2>&1
echo "pytest rc $?"; tail -n 3 $OUT/pytest_sc64.log
