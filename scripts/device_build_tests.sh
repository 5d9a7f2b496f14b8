#!/usr/bin/env bash
# usage: [TEST_TIMEOUT=s] bash scripts/device_build_tests.sh fwd|bwd BUILD
# The forward-side or backward-side GPU test files on a build made on the CPU machine and carried in
# .prebuilt/pack/p.tar.xz as .prebuilt/BUILD (extracted here if not yet), for A/B calls that test a variant before
# timing it. Head dims and dtypes outside the build skip. Log: $OUT/pytest_BUILD.log; the extension left in place is
# BUILD's.
set -u
SIDE=$1 B=$2
COMMON="tests/test_features_gpu.py tests/test_varlen_gpu.py tests/test_documents_gpu.py tests/test_bug_reports_gpu.py
  tests/test_bug_reports_more_gpu.py tests/test_bug_reports_third_gpu.py"
case $SIDE in
  fwd) FILES="tests/test_fwd_gpu.py tests/test_fwd_boundary_gpu.py tests/test_head_dims_gpu.py $COMMON" ;;
  bwd) FILES="tests/test_bwd_gpu.py tests/test_deterministic_gpu.py tests/test_bwd_gqa_group_gpu.py $COMMON" ;;
  *) echo "usage: device_build_tests.sh fwd|bwd BUILD"; exit 2 ;;
esac
if [[ ! -f .prebuilt/$B/_C.abi3.so ]]; then
  python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
fi
cp -f .prebuilt/$B/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -rf --timeout 100 $FILES > $OUT/pytest_$B.log 2>&1
echo "pytest $B rc $?"; tail -n 3 $OUT/pytest_$B.log
