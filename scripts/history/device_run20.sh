#!/usr/bin/env bash
# Development call for document_ids (head_dim 64 bf16 builds made on the CPU machine, carried in .prebuilt/): resource
# usage of both builds (cuobjdump), the GPU tests that build runs, the head_dim 64 forward/backward A/B against the
# previous build's resource usage (.prebuilt/B) and the cost of documents at train_lm's shape (scripts/doc_cost.py). Results in $OUT.
set -u
export PYTHONPATH=$PWD
for v in B docs; do
  echo "== resources $v"
  cuobjdump --dump-resource-usage .prebuilt/$v/_C.abi3.so 2>/dev/null | grep -A1 "flash_\(fwd\|bwd\)_sm90_kernel" \
    | grep -o "REG:[0-9]* STACK:[0-9]*" | sort | uniq -c
done
cp -f .prebuilt/docs/_C*.so flash_attn_hopper/
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -x -p no:cacheprovider tests/test_documents_gpu.py tests/test_features_gpu.py \
  tests/test_fwd_gpu.py tests/test_bwd_gpu.py tests/test_transformers_gpu.py tests/test_compile_gpu.py > $OUT/pytest_docs.log 2>&1
echo "pytest rc $?"; grep -E "FAILED|Error" $OUT/pytest_docs.log | head -20; tail -n 2 $OUT/pytest_docs.log
timeout 60 python3 scripts/doc_cost.py --json $OUT/doc_cost.json
cp -f .prebuilt/docs/_C*.so flash_attn_hopper/
timeout 60 python3 -m flash_attn_hopper.benchmark --head-dims 64 --features dense --backends ours,cudnn \
  --seqlens 1024,4096 --no-check --no-bar --json $OUT/ab_docs.json > $OUT/ab_docs.log 2>&1
echo "bench rc $?"
