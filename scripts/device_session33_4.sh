#!/usr/bin/env bash
# Session 33, call 4: the backward's tail split (csrc/flash/bwd/tail_split.hpp) on H34 (the working tree's full build,
# made on the CPU machine with the device's torch, carried in .prebuilt/pack/p.tar.xz). The forward kernels' SASS is
# H33's (checked on the CPU machine), so the forward-side tests of call 1 stand for them. First the backward-side
# GPU test files, the tail split's own tests and the fourth bug-report round; then FAH_BWD_TAIL_SPLIT=0 against the
# default, 3 rounds, non-causal dense (the split's only case) and causal as a control (no split there).
# Prediction (the model: 15.52 -> 15.71 waves at head_dim 128/256 4096-16384, 31.03 -> ~31.2 at head_dim 64; call 2's
# 16-full-wave sizing read the backward +2-4 %): non-causal +1.5-3 % at head_dim 64 from 1024 and at head_dim 128/256
# from 4096; level at head_dim 128/256 1024-2048 (no split planned) and with the causal mask.
set -u
export PYTHONUNBUFFERED=1
B=${B:-H34}
if [[ ! -f .prebuilt/$B/_C.abi3.so ]]; then
  python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
fi
cp -f .prebuilt/$B/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfs --timeout 100 tests/test_bwd_tail_split_gpu.py \
  tests/test_bug_reports_fourth_gpu.py > $OUT/pytest_tail.log 2>&1
echo "tail split + fourth round rc $?"; tail -n 4 $OUT/pytest_tail.log
grep -E "^(FAILED|ERROR)" $OUT/pytest_tail.log | head -20
CASES="$B FAH_BWD_TAIL_SPLIT=0;$B" DIRECTION=bwd ROUNDS=${ROUNDS:-3} TAG=tail BACKENDS=ours \
  BENCH="--head-dims 64,128,256 --causal both --features dense --seqlens 1024,4096,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-150} bash scripts/device_env_ab.sh > /dev/null
tar xzf $OUT/env_ab_tail.tar.gz -C /tmp && python3 scripts/ab_compare.py /tmp/env_ab_tail ${B}_FAH_BWD_TAIL_SPLIT_0 $B bwd \
  | tee $OUT/ab_tail.txt
TEST_TIMEOUT=${TEST_TIMEOUT:-300} bash scripts/device_build_tests.sh bwd $B
grep -E "^(FAILED|ERROR)" $OUT/pytest_$B.log | head -20
