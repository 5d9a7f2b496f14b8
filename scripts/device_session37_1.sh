#!/usr/bin/env bash
# Session 37: a forward build NEW (X: the exp2 of rounded products, FMUL + FADD per score; Y: one FFMA with the
# one-hot rows; Z: the warp's rows recomputed exactly at the tile's end where needed), made on the CPU machine with
# the device's torch and carried in .prebuilt/pack, against H2 (session 36's head build): the forward and huge-score
# test files on NEW, then the forward A/B H2 vs NEW (dense, head dims AB_HD (default 64,128,256), both masks,
# 1024/4096/16384, 2 rounds, order reversed).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
N=${NEW:-X}; n=$(echo $N | tr A-Z a-z)
for p in h2 $n; do python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" .prebuilt/pack/$p.tar.xz || exit 1; done
rm -f flash_attn_hopper/_C*.so; cp .prebuilt/$N/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -x -p no:cacheprovider tests/test_bug_reports_fifth_gpu.py \
  ${TEST_FILES:-tests/test_fwd_gpu.py tests/test_head_dims_gpu.py} > $OUT/tests_$N.log 2>&1
echo "tests rc $?"; tail -n 5 $OUT/tests_$N.log
CASES="H2;$N" DIRECTION=fwd ROUNDS=2 TAG=$n BACKENDS=ours \
  BENCH="--head-dims ${AB_HD:-64,128,256} --causal both --features dense --seqlens 1024,4096,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-200} bash scripts/device_env_ab.sh
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv > $OUT/smi.txt
