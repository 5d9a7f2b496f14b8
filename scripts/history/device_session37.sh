#!/usr/bin/env bash
# Session 37: forward builds made on the CPU machine with the device's torch (carried in .prebuilt/pack as
# lower-case NAME.tar.xz) against H2 (session 36's head build). X = the exp2 of rounded products (FMUL + FADD per
# score); Y = one FFMA with one-hot rows past 2^30; ZD = the exact-rows redo plus the non-lazy O rescale between stored
# rounded maxima; ZR = ZD without the redo; ZO = ZD with the old FFMA rescale; ZD2 = ZD with the tile-end test on raw
# maxima and per-thread sums; ZL = ZD2 with the lazy rescale at head_dim 64 too; ZN = ZL with the redo not inlined.
# The huge-score test file (plus TEST_FILES) on TEST_BUILD, then the forward A/B of H2 and BUILDS (dense bf16, head
# dims AB_HD, both masks, 1024/4096/16384, ROUNDS rounds, order reversed every other round), B / H2 per build.
# Calls 1-2 ran BUILDS=X (then Y) TEST_BUILD=same TEST_FILES="tests/test_fwd_gpu.py tests/test_head_dims_gpu.py"
# AB_HD=64,128,256 ROUNDS=2; calls 3-6 the Z builds at AB_HD=64,128.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
B=(${BUILDS:-ZD ZR ZO}); T=${TEST_BUILD:-${B[0]}}
for p in h2 $(echo ${B[@]} | tr A-Z a-z); do python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" .prebuilt/pack/$p.tar.xz || exit 1; done
rm -f flash_attn_hopper/_C*.so; cp .prebuilt/$T/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider tests/test_bug_reports_fifth_gpu.py ${TEST_FILES:-} \
  > $OUT/tests_$T.log 2>&1
echo "tests rc $?"; tail -n 3 $OUT/tests_$T.log
CASES="H2;$(echo ${B[@]} | tr ' ' ';')" DIRECTION=fwd ROUNDS=${ROUNDS:-2} TAG=z BACKENDS=ours \
  BENCH="--head-dims ${AB_HD:-64,128} --causal both --features dense --seqlens 1024,4096,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-300} bash scripts/device_env_ab.sh > /dev/null
tar xzf $OUT/env_ab_z.tar.gz -C /tmp
for b in ${B[@]}; do python3 scripts/ab_compare.py /tmp/env_ab_z H2 $b | awk -F'|' '{print $1 "|" $4}'; done
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv > $OUT/smi.txt
