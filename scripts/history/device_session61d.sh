#!/usr/bin/env bash
# Prepared in session 61, not run (the device time ran out). First, on DQEF (the head's kernels): round 29's GPU file
# as mended after its review, and round 28's FP test in its final form (dQ against the reference with D from the
# returned out, the naive yardstick shifted onto it); neither has run on a GPU. Then DQTF against DQEF: the
# deterministic dQ writer awaits its turn before the tile's dQ barrier instead of after it, so that the acquire round
# trip (~780 cycles a tile in session 61's lanes trace even where the turn is already there; an upper bound, see
# benchmarks/NOTES.md "Next steps") runs while the consumers still compute. Pack: REV=dqtf NAME=DQTF
# FAH_HDIMS=128,256 FAH_DTYPES=bf16 bash scripts/build_pack.sh (branch dqtf; DQEF: the head, full build). Two rounds
# in alternating order of head_dim 256 (bwd256_points) and head_dim 128 deterministic points, then DQTF's tests.
# About 250-400 s after the start (not timed as a whole; call 3 of session 61 ran 4 bwd256_points rounds in ~130 s).
#   carry [".prebuilt/pack/dqef.tar.xz", ".prebuilt/pack/dqtf.tar.xz"]
TAG=s61d source "$(dirname "$0")/device_packs.sh" dqef dqtf
use_pack DQEF
round29_check
timeout ${R28_S:-120} python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_bug_reports_twentyeighth_gpu.py \
  -k persistent_tiles > "$OUT/round28_fp.log" 2>&1
echo "round 28 FP rc $?: $(tail -n 1 "$OUT/round28_fp.log")"
grep -m 15 "^FAILED\|^ERROR\|^E  " "$OUT/round28_fp.log"
det128() {
  for c in yes no; do GQA_DETERMINISTIC=1 GQA_CAUSAL=$c timeout 30 python3 scripts/gqa_bwd_points.py 4096,16384 16 128 \
    | grep -v "^#" | sed 's/$/ deterministic/'; done
}
{ for r in "DQEF 1" "DQTF 1" "DQTF 2" "DQEF 2"; do bwd256_points $r; det128; done; } 2>&1 | tee "$OUT/dqtf_ab.txt"
use_pack DQTF
pytest_log tests_DQTF tests ${TEST_S:-150} 8 tests/test_deterministic_gpu.py tests/test_bug_reports_twentysixth_gpu.py \
  tests/test_bug_reports_twentyseventh_gpu.py tests/test_bwd_gpu.py tests/test_documents_gpu.py \
  tests/test_random_configs_gpu.py
timeout ${SAN_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_sanitizer_gpu.py -k "d256-bfloat16" \
  > "$OUT/sanitizer_DQTF.log" 2>&1
echo "sanitizer rc $?: $(tail -n 1 "$OUT/sanitizer_DQTF.log")"
