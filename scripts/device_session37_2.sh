#!/usr/bin/env bash
# Session 37: where build ZD's head_dim 64 forward loss comes from. ZD = the exact-rows redo plus the non-lazy O
# rescale between stored rounded maxima; ZR = ZD without the redo; ZO = ZD with the old FFMA rescale; ZD2 = ZD with
# the tile-end test on raw maxima and per-thread sums; ZL = ZD2 with the lazy rescale at head_dim 64 too. The
# huge-score test file on TEST_BUILD, then the forward A/B of H2 and BUILDS (dense bf16, head_dim 64 and 128, both
# masks, 1024/4096/16384, ROUNDS rounds).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
B=(${BUILDS:-ZD ZR ZO}); T=${TEST_BUILD:-ZD}
for p in h2 $(echo ${B[@]} | tr A-Z a-z); do python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" .prebuilt/pack/$p.tar.xz || exit 1; done
rm -f flash_attn_hopper/_C*.so; cp .prebuilt/$T/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_bug_reports_fifth_gpu.py > $OUT/tests_$T.log 2>&1
echo "tests rc $?"; tail -n 3 $OUT/tests_$T.log
CASES="H2;$(echo ${B[@]} | tr ' ' ';')" DIRECTION=fwd ROUNDS=${ROUNDS:-2} TAG=z BACKENDS=ours \
  BENCH="--head-dims 64,128 --causal both --features dense --seqlens 1024,4096,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-300} bash scripts/device_env_ab.sh > /dev/null
tar xzf $OUT/env_ab_z.tar.gz -C /tmp
for b in ${B[@]}; do python3 scripts/ab_compare.py /tmp/env_ab_z H2 $b | awk -F'|' '{print $1 "|" $4}'; done
