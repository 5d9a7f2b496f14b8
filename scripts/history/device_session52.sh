#!/usr/bin/env bash
# S51 pack only: FAH_BWD_GQA_GLOBAL_ORDER, used below, was replaced by FAH_BWD_GQA_ORDER in f798bcd (session 52).
# The next device session's first call, prepared in session 51 (one warm machine, ~450 s; CPU-checked only): the GPU
# files not yet run to a verdict on the head's kernels, the GQA causal backward's group-mode A/B, the head_dim 128
# rotated walk's A/B, then the grid with the feature rows. Packs (scripts/build_pack.sh on the CPU machine; carry them):
# .prebuilt/pack/s51.tar.xz (the head's C++, every kernel) and rot128.tar.xz (ROT128: head_dim 128 bf16 only).
#   carry [".prebuilt/pack/s51.tar.xz", ".prebuilt/pack/rot128.tar.xz"]; OUT=$OUT bash scripts/history/device_session52.sh
# Time limits (seconds): TEST_S, GQA_S, ROT_S, GRID_S. Records under $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/s52}; mkdir -p "$OUT"
python3 -c "import tarfile; [tarfile.open(f'.prebuilt/pack/{s}.tar.xz').extractall('.prebuilt') for s in ('s51', 'rot128')]" || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv | tee "$OUT/smi.txt"
cp -f .prebuilt/S51/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1

# 1. GPU files without a verdict yet (session 51's rounds), on the head's kernels
timeout ${TEST_S:-90} python3 -m pytest -q -p no:cacheprovider tests/test_bug_reports_eighteenth_gpu.py \
  $(ls tests/test_bug_reports_nineteenth_gpu.py 2>/dev/null) --junitxml="$OUT/junit_new_rounds.xml" \
  > "$OUT/tests_new_rounds.log" 2>&1
echo "new rounds' tests rc $?"; tail -3 "$OUT/tests_new_rounds.log"

# 2. GQA causal backward, 16 query heads on 4: group CTAs in one longest-first order (the rule's choice at these
# shapes) against the group CTAs in L2 sections and against fp32 sums
CASES="S51;S51 FAH_BWD_GQA_GLOBAL_ORDER=0;S51 FAH_BWD_GQA_GROUP_CTA=0" DIRECTION=bwd ROUNDS=2 TAG=gqa OUT=$OUT \
  BENCH_TIMEOUT=60 \
  BENCH="--head-dims 128 --causal both --features gqa --seqlens 1024,4096 --no-check --no-adjacent" \
  timeout ${GQA_S:-100} bash scripts/device_env_ab.sh > "$OUT/ab_gqa.txt" 2>&1
echo "gqa a/b rc $?"

# 3. The rotated query-block walk at head_dim 128 (bwd_rotated_m_walk_hdim128_UNRUN.patch)
CASES="S51;ROT128" DIRECTION=bwd ROUNDS=3 TAG=rot128 OUT=$OUT BENCH_TIMEOUT=60 \
  BENCH="--head-dims 128 --causal both --features dense --seqlens 4096,16384 --no-check --no-adjacent" \
  timeout ${ROT_S:-90} bash scripts/device_env_ab.sh > "$OUT/ab_rot128.txt" 2>&1
echo "rot128 a/b rc $?"

# 4. The grid (dense, GQA, varlen, window, softcap, deterministic) on the head
cp -f .prebuilt/S51/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
timeout ${GRID_S:-140} python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 --direction both --no-bar \
  --json "$OUT/grid_S51.json" --summary "$OUT/grid_S51_summary.md" > "$OUT/grid.log" 2>&1
echo "grid rc $?"
