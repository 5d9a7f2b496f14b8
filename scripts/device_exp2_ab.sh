#!/usr/bin/env bash
# exp2 on the FMA pipe (exp2fma branch; utils.hpp exp2_fma, FwdKernelTraits::kExp2FmaOf8): forward tests on E8 (every
# exp2 of P emulated: the accuracy case), then forward TFLOP/s of S56 (none) / E4 / E8 at head_dim 64 and 128, dense
# and softcap 30 (bf16's fixed maximum) and 50 (the online maximum), 2 rounds. Predicted: head_dim 64 and the softcaps
# (MUFU-bound: one ex2 per score at head_dim 64 matches WGMMA's rate; the softcap's tanh doubles MUFU's work) +3-10 % at
# 4096-16384 with E4; head_dim 128 dense level. E4 / E8: FAH_HDIMS=64,128 FAH_DTYPES=bf16 packs (other tests skip).
#   carry [".prebuilt/pack/s56.tar.xz", ".prebuilt/pack/e4.tar.xz", ".prebuilt/pack/e8.tar.xz"]
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/exp2}; mkdir -p "$OUT"
for p in s56 e4 e8; do python3 -c "import tarfile; tarfile.open('.prebuilt/pack/$p.tar.xz').extractall('.prebuilt')" || exit 1; done
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv | tee "$OUT/smi.txt"
cp -f .prebuilt/E8/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${TESTS_S:-100} python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_fwd_gpu.py tests/test_softcap_accuracy_gpu.py \
  tests/test_features_gpu.py tests/test_fwd_boundary_gpu.py tests/test_bug_reports_fifth_gpu.py tests/test_bug_reports_gpu.py \
  tests/test_random_configs_gpu.py > "$OUT/tests_E8.log" 2>&1
echo "E8 tests rc $?: $(tail -n 1 "$OUT/tests_E8.log")"; grep -m 20 "^FAILED" "$OUT/tests_E8.log"
for r in 1 2; do
  order=(S56 E4 E8); (( r == 2 )) && order=(E8 E4 S56)
  for b in "${order[@]}"; do
    cp -f .prebuilt/$b/_C.abi3.so flash_attn_hopper/_C.abi3.so
    echo "== round $r: $b"
    timeout 40 python3 scripts/fwd_points.py 64,128 4096,16384 --causal both | grep -v head_dim
    timeout 30 python3 scripts/fwd_points.py 64,128 4096,16384 --causal no --softcap 30 | grep -v head_dim
    timeout 30 python3 scripts/fwd_points.py 128 16384 --causal both --softcap 50 | grep -v head_dim
  done
done 2>&1 | tee "$OUT/exp2_ab.txt"
