#!/usr/bin/env bash
# A forward variant against the submitted kernels in one device call, from builds made on the CPU machine
# (.prebuilt/pack/p.tar.xz): the forward test files on .prebuilt/$VARIANT, then scripts/device_env_ab.sh over $CASES
# (e.g. "FINAL;$VARIANT") with $BENCH, $ROUNDS rounds, records tagged $TAG; test tail in $OUT/pytest_$VARIANT.log.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_before.txt
cp -f .prebuilt/$VARIANT/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -x tests/test_fwd_gpu.py tests/test_features_gpu.py \
  tests/test_fwd_boundary_gpu.py 2>&1 | tail -n 5 | tee $OUT/pytest_$VARIANT.log
CASES="$CASES" DIRECTION=fwd ROUNDS=${ROUNDS:-2} TAG=$TAG BACKENDS=ours BENCH="$BENCH" \
  timeout ${AB_TIMEOUT:-260} bash scripts/device_env_ab.sh
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv | tee $OUT/smi_after.txt
