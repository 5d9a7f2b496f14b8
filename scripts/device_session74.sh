#!/usr/bin/env bash
# The first device call planned in session 74 (no device was lent that session), on a pack of the head's C++ built
# here with the device's torch (scripts/build_pack.sh): the document-bounds partition's timing (its fast path,
# f1ec376, never run), a short check of the benchmark's per-point references (b8f3f39: every feature point checked,
# no point should be flagged), then scripts/device_session68.sh: the SASS / HGMMA check, the first files, and the
# parallel phase and the memory / tools groups (rounds 40-42 run there). No grid: on an H200 run it in a second,
# warm call (benchmark's --rounds 2 when short of budget).
#   carry [".prebuilt/pack/s74.tar.xz", ".whl"]; OUT as the device gives it; BUDGET (default 540)
# Environment: PREBUILT / PACK (default S74 / s74), BUDGET, WORKERS (default 6 where the machine has 12 cores or
#   more, else 4).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/s74}; mkdir -p "$OUT"
BUDGET=${BUDGET:-540}
T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
PREBUILT=${PREBUILT:-S74}; PACK=${PACK:-s74}
nvidia-smi --query-gpu=name --format=csv,noheader; echo "nproc $(nproc)"
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/$PACK.tar.xz').extractall('.prebuilt')"
cp ".prebuilt/$PREBUILT/_C.abi3.so" flash_attn_hopper/_C.abi3.so
PYTHONPATH=$PWD FAH_PREBUILT=1 timeout 45 python3 scripts/doc_partition_time.py > "$OUT/docpart_time.txt" 2>&1
echo "partition timing rc $?"; tail -n 6 "$OUT/docpart_time.txt"
PYTHONPATH=$PWD FAH_PREBUILT=1 timeout 60 python3 -m flash_attn_hopper.benchmark --seqlens 1024 --head-dims 128 \
  --direction both --features dense,gqa,varlen,window,softcap,deterministic --rounds 1 --preheat 0 --no-adjacent \
  --no-bar --json "$OUT/check_points.json" > "$OUT/check_points.log" 2>&1
echo "benchmark check rc $? (FLAGGED points: $(grep -c FLAGGED "$OUT/check_points.log"))"
grep -o "hdim=.*" "$OUT/check_points.log" | cut -c1-300 | head -n 12
rm -f flash_attn_hopper/_C.abi3.so  # device_session68.sh loads the pack itself
W=4; (( $(nproc) >= 12 )) && W=6
WORKERS=${WORKERS:-$W} PREBUILT=$PREBUILT PACK=$PACK GRID=0 \
  FIRST="tests/test_doc_bounds_partition_gpu.py tests/test_bug_reports_thirtyninth_gpu.py tests/test_bwd_gpu.py
         tests/test_deterministic_gpu.py tests/test_bug_reports_fifth_gpu.py" \
  REST_PHASES="parallel groups" OUT="$OUT" BUDGET=$(left) bash scripts/device_session68.sh
