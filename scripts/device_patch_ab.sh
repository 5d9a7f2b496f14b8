#!/usr/bin/env bash
# A kernel patch against the tree in one device call: keeps the tree's built extension as .prebuilt/BASE, applies
# PATCH, builds it (every kernel unless FAH_HDIMS / FAH_DTYPES narrow it: ~2 minutes on the H200 with 16 jobs) as
# .prebuilt/$NAME, runs TESTS on it (narrow them with TEST_K to what a narrowed build holds), then the A/B of BASE
# against $NAME through scripts/device_env_ab.sh (BENCH, DIRECTION, ROUNDS, BENCH_TIMEOUT per run), and restores the
# tree, its .so and its build log, also when the call's time limit ends it early.
# Needs a built tree (e.g. after scripts/device_check_parallel.sh on the same warm machine).
#   PATCH=benchmarks/results/.../x.patch NAME=DV DIRECTION=bwd \
#     BENCH="--head-dims 64,128 --causal both --features dense --seqlens 1024,4096,16384 --no-check --no-adjacent" \
#     TESTS="tests/test_bwd_gpu.py tests/test_features_gpu.py" bash scripts/device_patch_ab.sh
# Defaults keep the worst case inside a 600 s call: TEST_TIMEOUT 180, ROUNDS 2, BENCH_TIMEOUT 50. Results in $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
: "${PATCH:?PATCH=file}" "${NAME:?NAME=build name}" "${BENCH:?BENCH=benchmark arguments}"
OUT=${OUT:-/tmp/patch_ab}; mkdir -p "$OUT"
[[ -f flash_attn_hopper/_C.abi3.so ]] || { echo "no built extension in the tree"; exit 1; }
git apply --check "$PATCH" || { echo "the patch does not apply"; exit 1; }
mkdir -p .prebuilt/BASE ".prebuilt/$NAME"
cp -f flash_attn_hopper/_C.abi3.so .prebuilt/BASE/_C.abi3.so
LOG=.fah_build/gpu_check/build.log
[[ -f $LOG ]] && cp -f "$LOG" .prebuilt/BASE/build.log
applied=0
restore() {
  if (( applied )); then git apply -R "$PATCH" && applied=0; fi
  cp -f .prebuilt/BASE/_C.abi3.so flash_attn_hopper/_C.abi3.so
  if [[ -f .prebuilt/BASE/build.log ]]; then mkdir -p .fah_build/gpu_check; cp -f .prebuilt/BASE/build.log "$LOG"; fi
}
trap restore EXIT
git apply "$PATCH" && applied=1
rm -rf build .fah_build/build_temp; rm -f flash_attn_hopper/_C*.so  # a failed build must not leave BASE's .so
OUT=/tmp/gc_$NAME FAH_SKIP_TESTS=1 FAH_SKIP_BENCH=1 bash scripts/gpu_check.sh > "$OUT/build_$NAME.log" 2>&1
echo "build $NAME rc $?"; grep -E "^(build|sass) |HGMMA check" "$OUT/build_$NAME.log" | tail -n 6
git apply -R "$PATCH" && applied=0
[[ -f flash_attn_hopper/_C.abi3.so ]] || { echo "no build of $NAME"; exit 1; }
cp -f flash_attn_hopper/_C.abi3.so ".prebuilt/$NAME/_C.abi3.so"
if [[ -n ${TESTS:-} ]]; then
  K=(); if [[ -n ${TEST_K:-} ]]; then K=(-k "$TEST_K"); fi
  timeout -s INT -k 10 "${TEST_TIMEOUT:-180}" python3 -m pytest -q -rs $TESTS "${K[@]}" -p no:cacheprovider \
    > "$OUT/pytest_$NAME.log" 2>&1
  echo "tests on $NAME rc $?"; tail -n 4 "$OUT/pytest_$NAME.log"
fi
OUT=$OUT CASES="BASE;$NAME" ROUNDS=${ROUNDS:-2} BENCH_TIMEOUT=${BENCH_TIMEOUT:-50} TAG=$NAME bash scripts/device_env_ab.sh
