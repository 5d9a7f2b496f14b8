#!/usr/bin/env bash
# P's row sums on the tensor cores (branch rowsum: FwdKernelTraits::kRowSumMma, an N = 8 WGMMA of P against a tile of
# ones issued with P V; the RS pack, FAH_HDIMS=64,128 bf16): the forward tests on RS, then forward TFLOP/s of S56 / RS
# at head_dim 64 and 128, dense (causal and not) and softcap 50 (the online maximum; softcap 30's fixed maximum keeps
# its FADD sums), 2 rounds. Predicted (session 56's count: head_dim 64's consumer warps issue ~434 instructions per key
# block, 64 of them the row sum's FADDs, on the softmax's path): head_dim 64 +3-8 % at 4096-16384, head_dim 128 level
# to +3 %. ptxas: head_dim 64's 192-row dense kernel spills 8 B (S56: 4), its online-softcap kernel 76 B (S56: 8).
#   carry [".prebuilt/pack/s56.tar.xz", ".prebuilt/pack/rs.tar.xz"]; OUT=$OUT bash scripts/device_rowsum_ab.sh
# The RS pack, if missing: NAME=RS PATCHES=benchmarks/results/2026-12-06_session56/rowsum_on_UNRUN.patch \
#   FAH_HDIMS=64,128 FAH_DTYPES=bf16 bash scripts/build_pack.sh   (S56: NAME=S56, this head's C++ = 7b8703e's)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/rowsum}; mkdir -p "$OUT"
for p in s56 rs; do
  python3 -c "import tarfile; tarfile.open('.prebuilt/pack/$p.tar.xz').extractall('.prebuilt')" || exit 1
done
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv | tee "$OUT/smi.txt"
cp -f .prebuilt/RS/_C.abi3.so flash_attn_hopper/_C.abi3.so
FILES="test_fwd_gpu test_softcap_accuracy_gpu test_features_gpu test_fwd_boundary_gpu test_bug_reports_fifth_gpu
       test_bug_reports_gpu test_random_configs_gpu test_fwd_tiles_gpu test_bwd_gpu test_varlen_gpu"
timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -n 8 $(for f in $FILES; do echo tests/$f.py; done) \
  > "$OUT/tests_RS.log" 2>&1
echo "RS tests rc $?: $(tail -n 1 "$OUT/tests_RS.log")"; grep -m 20 "^FAILED" "$OUT/tests_RS.log"
for r in 1 2; do
  order=(S56 RS); (( r == 2 )) && order=(RS S56)
  for b in "${order[@]}"; do
    cp -f .prebuilt/$b/_C.abi3.so flash_attn_hopper/_C.abi3.so
    echo "== round $r: $b"
    timeout 40 python3 scripts/fwd_points.py 64,128 1024,4096,16384 --causal both | grep -v head_dim
    timeout 30 python3 scripts/fwd_points.py 64,128 4096,16384 --causal no --softcap 50 | grep -v head_dim
  done
done 2>&1 | tee "$OUT/rowsum_ab.txt"
