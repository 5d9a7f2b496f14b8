# Sourced by the device scripts that A/B carried packs (scripts/build_pack.sh): unpacks each named pack stem from
# .prebuilt/pack/ into .prebuilt/, sets up the environment, and records the card into $OUT/smi_$TAG.txt.
#   OUT=... TAG=... source scripts/device_packs.sh s56 dqe ...; then use_pack NAME before each build's runs.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/${TAG:-packs}}; mkdir -p "$OUT"
for stem in "$@"; do
  python3 -c "import tarfile; tarfile.open('.prebuilt/pack/$stem.tar.xz').extractall('.prebuilt')" || exit 1
done
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv | tee "$OUT/smi_${TAG:-packs}.txt"
use_pack() { cp -f ".prebuilt/$1/_C.abi3.so" flash_attn_hopper/_C.abi3.so || exit 1; }
# head_dim 256 backward points of one build (session 59's A/Bs): causal and not at 4096 and 16384, deterministic causal
# at both and non-causal at 16384; dense 16/16, bf16.  bwd256_points NAME ROUND
bwd256_points() {
  use_pack $1; echo "== round $2: $1 ${FAH_BWD_DQ_PAIR:-}"
  for c in yes no; do GQA_CAUSAL=$c timeout 30 python3 scripts/gqa_bwd_points.py 4096,16384 16 256 | grep -v "^#"; done
  GQA_DETERMINISTIC=1 GQA_CAUSAL=yes timeout 30 python3 scripts/gqa_bwd_points.py 4096,16384 16 256 \
    | grep -v "^#" | sed 's/$/ deterministic/'
  GQA_DETERMINISTIC=1 GQA_CAUSAL=no timeout 30 python3 scripts/gqa_bwd_points.py 16384 16 256 \
    | grep -v "^#" | sed 's/$/ deterministic/'
}
# Forward TFLOP/s of one build at head_dim 64, bf16, causal and not, with the tile height forced (session 66's A/Bs).
#   fwd64_points NAME ROUND BLOCK_M SEQLENS SECONDS
fwd64_points() {
  use_pack $1; echo "== round $2: $1"
  FAH_FWD_BLOCK_M=$3 timeout $5 python3 scripts/fwd_points.py 64 $4 --causal both | grep -v "head_dim\|---"
}
# Round 29's GPU file with its junit record, and the path each compiled FS step took (session 61's scripts).
round29_check() {
  timeout ${R29_S:-100} python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_bug_reports_twentyninth_gpu.py \
    --junitxml="$OUT/round29.xml" > "$OUT/round29.log" 2>&1
  echo "round 29 rc $?: $(tail -n 1 "$OUT/round29.log")"
  grep -m 15 "^FAILED\|^ERROR" "$OUT/round29.log"
  grep -o 'name="fs_[a-z]*_backward_paths" value="[a-z,]*"' "$OUT/round29.xml"
}
# pytest on ARGS with its output in $OUT/NAME.log under a time limit (WORKERS empty: one process); prints "LABEL rc N:"
# with pytest's last line, then the first failures.  pytest_log NAME LABEL SECONDS WORKERS ARGS...
pytest_log() {
  local name=$1 label=$2 secs=$3 workers=$4; shift 4
  timeout "$secs" python3 -m pytest -q -p no:cacheprovider ${workers:+-n "$workers"} "$@" > "$OUT/$name.log" 2>&1
  echo "$label rc $?: $(tail -n 1 "$OUT/$name.log")"
  grep -m 20 "^FAILED\|^ERROR" "$OUT/$name.log"
}
