#!/usr/bin/env bash
# Forward A/B in one device call: a development build (FAH_HDIMS, default 64; bf16), the forward GPU tests of that
# head dim, then the forward benchmark of each variant named in AB (env assignments separated by ';', e.g.
# "FAH_FWD_BLOCK_M=128;FAH_FWD_BLOCK_M=192"), each with ours and cuDNN from the same process. Results in $OUT.
set -u
export PYTHONUNBUFFERED=1
HD=${FAH_HDIMS:-64}
rm -f flash_attn_hopper/_C*.so; rm -rf build .fah_build
T0=$(date +%s)
FAH_HDIMS=$HD FAH_DTYPES=${FAH_DTYPES:-bf16} FAH_SKIP_TESTS=1 FAH_SKIP_BENCH=1 OUT=/tmp/gc timeout 300 \
  bash scripts/gpu_check.sh > /tmp/gc.out 2>&1
echo "gpu_check (build + sass) rc $? in $(( $(date +%s) - T0 )) s"
grep -E "^(build|sass) " /tmp/gc.out
cp /tmp/gc/build.log $OUT/ 2>/dev/null
grep -A2 "flash_fwd_sm90_kernel" .fah_build/gpu_check/build.log | grep -E "spill|Used" | sort | uniq -c | head
ls flash_attn_hopper/_C*.so || exit 1
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -x tests/test_fwd_gpu.py tests/test_features_gpu.py tests/test_varlen_gpu.py \
  -k "${TEST_K:-64 and bf16}" -p no:cacheprovider 2>&1 | tail -n 6
IFS=';' read -ra VARIANTS <<< "${AB:-FAH_FWD_BLOCK_M=128;FAH_FWD_BLOCK_M=192}"
i=0
for v in "${VARIANTS[@]}"; do
  echo "== variant $i: $v"
  env $v timeout 200 python3 -m flash_attn_hopper.benchmark --head-dims $HD --direction fwd --features dense \
    --backends ours,cudnn --no-bar ${BENCH_ARGS:-} --json $OUT/ab_$i.json 2>&1 | grep "^| dense" | cut -d'|' -f3-9
  i=$((i+1))
done
