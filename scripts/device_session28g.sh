#!/usr/bin/env bash
# Session 28, on the machine that built the tree in device_session28f.sh (if that machine was given back, the build is
# made again first): test_varlen_gpu.py, then the full grid (ours, cuDNN, FA2, the feature points with their dense
# references timed beside them) with its summary and plots.
set -u
export PYTHONUNBUFFERED=1
if ! ls flash_attn_hopper/_C*.so 2>/dev/null; then
  echo "no build from the previous call here: building"
  rm -rf build .fah_build
  FAH_SKIP_TESTS=1 FAH_SKIP_BENCH=1 timeout 300 bash scripts/gpu_check.sh > $OUT/rebuild.out 2>&1
  tail -n 3 $OUT/rebuild.out
fi
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_varlen_gpu.py 2>&1 | tail -n 4 | tee $OUT/pytest_varlen.log
FAH_PREBUILT=1 FAH_SKIP_TESTS=1 timeout ${GRID_TIMEOUT:-400} bash scripts/gpu_check.sh > $OUT/grid.out 2>&1
echo "grid rc $?"
cp .fah_build/gpu_check/{bench_attention.json,bench_extra.tar.gz,summary.txt} $OUT/ 2>/dev/null
tail -n 5 $OUT/grid.out
