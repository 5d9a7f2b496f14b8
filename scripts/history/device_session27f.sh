#!/usr/bin/env bash
# Session 27 call 6, on the machine that built the tree in call 5 (or, if that machine was given back, on the carried
# build .prebuilt/FINAL of the same kernel code): test_varlen_gpu.py, then the full grid (ours, cuDNN, FA2, the feature
# points with their dense references timed beside them) with its summary and plots.
set -u
export PYTHONUNBUFFERED=1
if ! ls flash_attn_hopper/_C*.so 2>/dev/null; then
  echo "no build from call 5 here: using .prebuilt/FINAL"
  python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
  cp -f .prebuilt/FINAL/_C.abi3.so flash_attn_hopper/_C.abi3.so
fi
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_varlen_gpu.py 2>&1 | tail -n 4 | tee $OUT/pytest_varlen.log
FAH_PREBUILT=1 FAH_SKIP_TESTS=1 timeout ${GRID_TIMEOUT:-400} bash scripts/gpu_check.sh > $OUT/grid.out 2>&1
echo "grid rc $?"
cp .fah_build/gpu_check/{bench_attention.json,bench_extra.tar.gz,summary.txt} $OUT/ 2>/dev/null
tail -n 5 $OUT/grid.out
