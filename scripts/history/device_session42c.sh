#!/usr/bin/env bash
# Session 42, last call, on S42 (a full build of the session's tree made on the CPU machine with the device's torch,
# carried in .prebuilt/pack/s42.tar.xz): the GPU tests of what changed (the backward's launch choices for windows
# that hide no key, attention_varlen's checked-call cache, the ninth round of bug reports), then the varlen host cost
# beside the head's interface.py (.prebuilt/old_interface.py), then the GQA window points (the rule against the fp32
# sums forced, which is what such a window ran before).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" .prebuilt/pack/s42.tar.xz || exit 1
cp -f .prebuilt/S42/_C.abi3.so flash_attn_hopper/_C.abi3.so
T="tests/test_bwd_gpu.py::test_gqa_group_rule_below_two_waves tests/test_deterministic_gpu.py tests/test_varlen_gpu.py
   tests/test_compile_gpu.py tests/test_transformers_gpu.py tests/test_bug_reports_third_gpu.py
   tests/test_bug_reports_fourth_gpu.py tests/test_bug_reports_more_gpu.py tests/test_bug_reports_sixth_gpu.py
   tests/test_bug_reports_seventh_gpu.py tests/test_bug_reports_eighth_gpu.py tests/test_validation_cpu.py
   tests/test_bug_reports_eighth_cpu.py tests/test_bug_reports_ninth_cpu.py ${NINTH:-tests/test_bug_reports_ninth_gpu.py}"
timeout ${TEST_TIMEOUT:-260} python3 -m pytest -q -rs -p no:cacheprovider --timeout 120 --timeout-method thread $T \
  > $OUT/pytest_s42.log 2>&1
echo "pytest rc $?"; tail -n 12 $OUT/pytest_s42.log
timeout 60 python3 -m pytest -q -p no:cacheprovider --timeout 60 tests/test_bug_reports_gpu.py tests/test_bug_reports_fifth_gpu.py \
  -k varlen > $OUT/pytest_s42_varlen_k.log 2>&1
echo "pytest -k varlen rc $?"; tail -n 3 $OUT/pytest_s42_varlen_k.log
# the varlen host cost: the head's interface.py against this tree's
rm -rf /tmp/oldpkg && mkdir -p /tmp/oldpkg && cp -r flash_attn_hopper /tmp/oldpkg/ && cp .prebuilt/old_interface.py /tmp/oldpkg/flash_attn_hopper/interface.py
for r in 1 2; do
  echo "== head's interface.py, process $r"; PYTHONPATH=/tmp/oldpkg timeout 60 python3 scripts/varlen_spread.py 1024 128
  echo "== this tree, process $r"; timeout 60 python3 scripts/varlen_spread.py 1024 128
done 2>&1 | tee $OUT/varlen_spread_ab.txt
for mode in rule 0; do
  echo "== GQA window (5000, 5000), FAH_BWD_GQA_GROUP_CTA=${mode}"
  if [[ $mode == rule ]]; then unset FAH_BWD_GQA_GROUP_CTA; else export FAH_BWD_GQA_GROUP_CTA=$mode; fi
  GQA_CAUSAL=no GQA_WINDOW=5000,5000 timeout 60 python3 scripts/gqa_bwd_points.py 1024,4096 2 128
done 2>&1 | tee $OUT/gqa_window_points.txt
