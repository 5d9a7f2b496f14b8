#!/usr/bin/env bash
# Forward A/B from extension builds made on the CPU machine against torch 2.11 (head_dim 64, bf16; carried in the
# git-ignored .prebuilt/<variant>/): the head_dim 64 forward grid (512-4096) and train_lm's attention shape (batch 8,
# 12 heads, seqlen 2048, causal), ours and cuDNN from the same process, per variant; then the forward GPU tests with
# the variant TEST_VARIANT. Results in $OUT.
set -u
export PYTHONPATH=$PWD
for v in ${VARIANTS:-A B}; do
  cp -f .prebuilt/$v/_C*.so flash_attn_hopper/ || exit 1
  echo "== variant $v"
  timeout 60 python3 -m flash_attn_hopper.benchmark --head-dims 64 --direction fwd --features dense --backends ours,cudnn \
    --seqlens 512,1024,2048,4096 --no-check --no-bar --json $OUT/ab_$v.json 2>&1 | grep "^| dense" | cut -d'|' -f3-9
  timeout 30 python3 -m flash_attn_hopper.benchmark --head-dims 64 --direction fwd --features dense --backends ours,cudnn \
    --hidden 768 --seqlens 2048 --causal yes --no-check --no-bar --json $OUT/ab_train_$v.json 2>&1 | grep "^| dense" | cut -d'|' -f3-9
done
cp -f .prebuilt/${TEST_VARIANT:-B}/_C*.so flash_attn_hopper/
timeout ${TEST_TIMEOUT:-90} python3 -m pytest -q -p no:cacheprovider tests/test_fwd_gpu.py tests/test_fwd_tiles_gpu.py \
  > $OUT/pytest_${TEST_VARIANT:-B}.log 2>&1
echo "pytest rc $?"; tail -n 3 $OUT/pytest_${TEST_VARIANT:-B}.log
