#!/usr/bin/env bash
# Session 33, call 3: the fourth round of bug-report GPU tests (tests/test_bug_reports_fourth_gpu.py, new, never run
# on a GPU) on H33, then head_dim 64's forward tile height forced to 128 / 192 rows against the launcher's choice
# (fwd_block_m: 128 at causal up to 4096, 192 from 8192; 128 non-causal at 1024, 192 from 2048), 2 rounds. Prediction:
# the launcher's choice is within 1 % of the better forced height everywhere (its cost constants came from sessions 5
# and 25); causal 4096 (ours/cuDNN 1.04, the weakest head_dim 64 point from 4096) is the one to watch.
set -u
export PYTHONUNBUFFERED=1
if [[ ! -f .prebuilt/H33/_C.abi3.so ]]; then
  python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
fi
cp -f .prebuilt/H33/_C.abi3.so flash_attn_hopper/_C.abi3.so
export FAH_FWD_SECTION_MIN_M_BLOCKS=8  # the committed default (H33 was built with 0)
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfs --timeout 120 tests/test_bug_reports_fourth_gpu.py \
  > $OUT/pytest_fourth.log 2>&1
echo "fourth round rc $?"; tail -n 30 $OUT/pytest_fourth.log
CASES="H33 FAH_FWD_BLOCK_M=128;H33 FAH_FWD_BLOCK_M=192;H33" DIRECTION=fwd ROUNDS=2 TAG=bm64 BACKENDS=ours \
  BENCH="--head-dims 64 --causal both --features dense --seqlens 1024,2048,4096,8192,16384 --no-check --no-adjacent" \
  timeout 150 bash scripts/device_env_ab.sh
# The backward's section budget (call 2 measured 24 MiB against off): 12 and 48 MiB beside 24, causal, 2 rounds.
CASES="H33 FAH_BWD_SECTION_MIB=12;H33 FAH_BWD_SECTION_MIB=48;H33" DIRECTION=bwd ROUNDS=2 TAG=bmib BACKENDS=ours \
  BENCH="--head-dims 64,128,256 --causal yes --features dense --seqlens 2048,4096,8192 --no-check --no-adjacent" \
  timeout 150 bash scripts/device_env_ab.sh
