#!/usr/bin/env bash
# Kept as a record: needs a build with the half-block skip, removed in c14cfef (patch in
# benchmarks/results/2026-12-03_h200_session28/fwd_half_skip_consumer_copies_NOT_KEPT.patch).
# Session 28 call 1 (build made on the CPU machine, .prebuilt/pack/p.tar.xz): HS = head_dim 64/128/256 bf16 with the
# forward's half-block skip (fwd_skips_half). The new skip tests, then the forward test files (head_dim 64's 128-row
# tiles forced too, in tests/test_fwd_tiles_gpu.py), on HS.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
cp -f .prebuilt/HS/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${T1:-200} python3 -m pytest -q -p no:cacheprovider tests/test_fwd_skip_gpu.py tests/test_fwd_boundary_gpu.py \
  2>&1 | tail -n 15 | tee $OUT/pytest_HS_skip_boundary.log
timeout ${T2:-200} python3 -m pytest -q -p no:cacheprovider tests/test_fwd_gpu.py tests/test_features_gpu.py \
  "tests/test_fwd_tiles_gpu.py::test_forced_block_m_passes_the_forward_tests" 2>&1 | tail -n 15 | tee $OUT/pytest_HS_fwd.log
