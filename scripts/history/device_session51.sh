#!/usr/bin/env bash
# Session 51's last device call (one warm machine, ~450 s): the A/B of the backward's rotated query-block walk (ROT)
# against the head (S51), the GPU test files that run the backward on ROT's kernels, then the grid on ROT if its
# tests passed and it was not slower, else on S51. Packs: .prebuilt/pack/s51.tar.xz and rot.tar.xz (full builds
# made on the CPU machine with scripts/build_pack.sh). Time limits: AB_S, TEST_S, GRID_S seconds.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/s51}; mkdir -p "$OUT"
python3 -c "import tarfile; [tarfile.open(f'.prebuilt/pack/{s}.tar.xz').extractall('.prebuilt') for s in ('s51', 'rot')]" || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > "$OUT/smi.txt"
cat "$OUT/smi.txt"

# 1. A/B (ours only, backward), order reversed every other round
CASES="S51;ROT" DIRECTION=bwd ROUNDS=${ROUNDS:-3} TAG=rot OUT=$OUT BENCH_TIMEOUT=60 \
  BENCH="--head-dims 64,128,256 --causal both --features dense --seqlens 4096,16384 --no-check --no-adjacent" \
  timeout ${AB_S:-110} bash scripts/device_env_ab.sh > "$OUT/ab.txt" 2>&1
echo "ab rc $?"

# 2. The backward's GPU files on ROT's kernels
cp -f .prebuilt/ROT/_C.abi3.so flash_attn_hopper/_C.abi3.so
files="tests/test_bwd_gpu.py tests/test_bwd_gqa_group_gpu.py tests/test_features_gpu.py tests/test_varlen_gpu.py
  tests/test_deterministic_gpu.py tests/test_head_dim_v_gpu.py tests/test_random_configs_gpu.py
  tests/test_bug_reports_gpu.py tests/test_bug_reports_fifth_gpu.py tests/test_bug_reports_more_gpu.py
  tests/test_bug_reports_third_gpu.py tests/test_bug_reports_fourth_gpu.py tests/test_bug_reports_tenth_gpu.py
  tests/test_bug_reports_fifteenth_gpu.py tests/test_bug_reports_sixteenth_gpu.py tests/test_documents_gpu.py
  $(ls tests/test_bug_reports_eighteenth_gpu.py 2>/dev/null)"
timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -n 4 --dist loadfile $files \
  --junitxml="$OUT/junit_rot.xml" > "$OUT/tests_rot.log" 2>&1
trc=$?; echo "tests rc $trc"; tail -3 "$OUT/tests_rot.log"

# 3. The grid on the build to land
pick=$(python3 - "$OUT" "$trc" <<'EOF'
import glob, json, statistics, sys, tarfile
out, trc = sys.argv[1], int(sys.argv[2])
t = {}
with tarfile.open(f"{out}/env_ab_rot.tar.gz") as tf:
    for m in tf.getmembers():
        if m.name.endswith(".json"):
            build = m.name.split("/")[-1].split("_r")[0]
            for r in json.load(tf.extractfile(m))["results"]:
                t.setdefault((r["head_dim"], r["causal"], r["seqlen"]), {}).setdefault(build, []).append(
                    r["bwd"]["tflops"]["ours"])
ratios = [statistics.median(v["ROT"]) / statistics.median(v["S51"]) for v in t.values() if "ROT" in v and "S51" in v]
for k in sorted(t):
    v = t[k]
    if "ROT" in v and "S51" in v:
        print(k, round(statistics.median(v["S51"]), 1), round(statistics.median(v["ROT"]), 1), file=sys.stderr)
g = statistics.geometric_mean(ratios) if ratios else 0
print(f"geomean ROT/S51 {g:.4f} over {len(ratios)} points, tests rc {trc}", file=sys.stderr)
print("ROT" if trc == 0 and g >= 1.0 else "S51")
EOF
)
pick=${pick:-S51}  # no A/B record (cut by AB_S): the head
echo "grid on $pick"
cp -f .prebuilt/$pick/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
timeout ${GRID_S:-130} python3 -m flash_attn_hopper.benchmark --seqlens 1024,4096,16384 --direction both --no-bar \
  --json "$OUT/grid_$pick.json" --summary "$OUT/grid_${pick}_summary.md" > "$OUT/grid.log" 2>&1
echo "grid rc $?"
