#!/usr/bin/env bash
# Session 56's check of 7b8703e (groups of 8 or more at head_dim > 128 under a causal-like mask take the fp32 sums):
# the S56 pack (this tree's C++), the backward and deterministic files in full plus every GPU test named for GQA /
# MQA / groups, then the launcher's new choice against the group CTAs forced (FAH_BWD_GQA_GROUP_CTA=1) at head_dim
# 256 and 192, causal, 16 query heads on 2 and 1. ~300 s on a warm machine.
#   carry [".prebuilt/pack/s56.tar.xz"]; OUT=$OUT bash scripts/history/device_session56.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/s56}; mkdir -p "$OUT"
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/s56.tar.xz').extractall('.prebuilt')" || exit 1
cp -f .prebuilt/S56/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv | tee "$OUT/smi.txt"
timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -n 8 --junitxml="$OUT/junit_s56.xml" \
  tests/test_bwd_gpu.py tests/test_deterministic_gpu.py tests/test_bwd_gqa_group_gpu.py \
  $(ls tests/*_gpu.py | grep -v -e test_bwd_gpu -e test_deterministic_gpu -e test_bwd_gqa_group_gpu -e sanitizer) \
  -k "gqa or mqa or group or nheads_k or test_bwd_gpu or test_deterministic_gpu or test_bwd_gqa_group_gpu" \
  > "$OUT/tests.log" 2>&1
echo "tests rc $?"; tail -n 3 "$OUT/tests.log"
for c in "X=1" "FAH_BWD_GQA_GROUP_CTA=1" "X=1"; do
  echo "== $c"
  env $c GQA_CAUSAL=yes timeout 40 python3 scripts/gqa_bwd_points.py 1024,2048,4096 2,1 256
  env $c GQA_CAUSAL=yes timeout 40 python3 scripts/gqa_bwd_points.py 1024,4096 2,1 192
done > "$OUT/gqa_s56.txt" 2>&1
echo "points done"; cat "$OUT/gqa_s56.txt"
