#!/usr/bin/env bash
# The head_dim 128 backward with dQ on one consumer warpgroup (branch dq1wg; prepared in session 53 with no device,
# compiled here only: no spills, no C7512), in two warm calls after scripts/history/device_session53.sh:
#   PART=tests (~400 s): the backward tests on DQ1 (the swapped kernel serves head_dim 65-128: every dtype, mask, GQA
#      form, varlen, deterministic mode), and racecheck / synccheck over the new barrier pattern
#      (test_sanitizer_gpu.py, d96 and d128 cases);
#   PART=ab (~330 s): the A/B of S52 (the head's C++ but for this change), DQ1 (dQ before dK, the branch's default)
#      and DQ1K (dK first: results/2026-12-05_session53/bwd_dq_one_wg_dk_first_UNRUN.patch, head_dim 128 only),
#      3 rounds, head_dim 128, causal both, 1024 / 4096 / 16384; then S52 against DQ1 at head_dim 64, 2 rounds (its
#      kernel is unchanged in intent; the SASS moved by a few instructions).
# Packs: S52, DQ1 (REV=dq1wg NAME=DQ1 bash scripts/build_pack.sh: a full build, so a win can go straight to
# scripts/device_check_parallel.sh PREBUILT=DQ1) and DQ1K (REV=dq1wg NAME=DQ1K FAH_HDIMS=128 PATCHES=that patch).
#   carry [".prebuilt/pack/s52.tar.xz", ".prebuilt/pack/dq1.tar.xz", ".prebuilt/pack/dq1k.tar.xz"];
#   PART=tests OUT=$OUT bash scripts/history/device_session53_dq1.sh, then PART=ab (same carry)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/s53dq1}; mkdir -p "$OUT"
python3 -c "import tarfile; [tarfile.open(f'.prebuilt/pack/{s}.tar.xz').extractall('.prebuilt') for s in ('s52', 'dq1', 'dq1k')]" \
  || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv | tee "$OUT/smi.txt"
grep -A1 "flash_bwd_sm90_kernel.*Li128ELi64ELi128" .prebuilt/DQ1/build.log | grep -c "0 bytes spill stores" \
  > "$OUT/dq1_spill_free_kernels.txt"

if [[ ${PART:-tests} == tests ]]; then
  cp -f .prebuilt/DQ1/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
  export FAH_PREBUILT=1 FAH_BUILD_LOG=$PWD/.prebuilt/DQ1/build.log
  timeout ${TESTS_S:-240} python3 -m pytest -q -x -p no:cacheprovider -n 4 --dist loadfile \
    tests/test_bwd_gpu.py tests/test_deterministic_gpu.py tests/test_bwd_gqa_group_gpu.py tests/test_varlen_gpu.py \
    tests/test_sections_gpu.py tests/test_features_gpu.py tests/test_random_configs_gpu.py --timeout 120 \
    --timeout-method thread \
    > "$OUT/dq1_tests.txt" 2>&1
  echo "dq1 tests rc $? ($(tail -n 1 "$OUT/dq1_tests.txt"))"
  timeout ${SAN_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_sanitizer_gpu.py -k "d96 or d128" \
    > "$OUT/dq1_sanitizer.txt" 2>&1
  echo "dq1 sanitizer rc $? ($(tail -n 1 "$OUT/dq1_sanitizer.txt"))"
fi
if [[ ${PART:-tests} == ab ]]; then
  CASES="S52;DQ1;DQ1K" DIRECTION=bwd ROUNDS=3 TAG=dq1 OUT=$OUT BENCH_TIMEOUT=60 \
    BENCH="--head-dims 128 --causal both --features dense --seqlens 1024,4096,16384 --no-check --no-adjacent" \
    timeout ${AB_S:-330} bash scripts/device_env_ab.sh > "$OUT/ab_dq1.txt" 2>&1
  echo "dq1 a/b rc $?"
  CASES="S52;DQ1" DIRECTION=bwd ROUNDS=2 TAG=dq1_64 OUT=$OUT BENCH_TIMEOUT=60 \
    BENCH="--head-dims 64 --causal both --features dense --seqlens 4096,16384 --no-check --no-adjacent" \
    timeout ${AB64_S:-120} bash scripts/device_env_ab.sh > "$OUT/ab_dq1_64.txt" 2>&1
  echo "dq1 a/b head_dim 64 rc $?"
fi
cp -f .prebuilt/S52/_C.abi3.so flash_attn_hopper/_C.abi3.so
