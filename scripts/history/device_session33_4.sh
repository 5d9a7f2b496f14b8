#!/usr/bin/env bash
# Session 33, call 4 (needs results/2026-12-03_h200_session33/bwd_tail_split_NOT_LANDED.patch applied: the tail
# split did not land): the backward's tail split (csrc/flash/bwd/tail_split.hpp) on H34 (that tree's full build,
# made on the CPU machine with the device's torch, carried in .prebuilt/pack/p.tar.xz). The forward kernels' SASS is
# H33's (checked on the CPU machine), so the forward-side tests of call 1 stand for them. First the backward-side
# GPU test files, the tail split's own tests and the fourth bug-report round; then FAH_BWD_TAIL_SPLIT=0 against the
# default, 3 rounds, non-causal dense (the split's only case).
# Prediction (the model, tail_split.hpp: makespan 0.975-0.98 of the unsplit one at head_dim 64 1024-16384 and at
# head_dim 128/256 4096-16384; call 2's 16-full-wave sizing read the backward +2-4 %): non-causal +1.5-2.5 % there;
# head_dim 128/256 at 1024 level (no split planned).
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
  BENCH="--head-dims 64,128,256 --causal no --features dense --seqlens 1024,4096,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-120} bash scripts/device_env_ab.sh > /dev/null
tar xzf $OUT/env_ab_tail.tar.gz -C /tmp && python3 scripts/ab_compare.py /tmp/env_ab_tail ${B}_FAH_BWD_TAIL_SPLIT_0 $B bwd \
  | tee $OUT/ab_tail.txt
# The backward-side files where the split runs (unmasked, not varlen, not deterministic), within what is left.
timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider -rf --timeout 100 tests/test_bwd_gpu.py \
  tests/test_features_gpu.py tests/test_head_dim_v_gpu.py tests/test_bug_reports_gpu.py tests/test_bug_reports_more_gpu.py \
  tests/test_bug_reports_third_gpu.py tests/test_bwd_gqa_group_gpu.py > $OUT/pytest_bwd_side.log 2>&1
echo "backward side rc $?"; tail -n 3 $OUT/pytest_bwd_side.log
grep -E "^(FAILED|ERROR)" $OUT/pytest_bwd_side.log | head -20
