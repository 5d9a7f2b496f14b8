#!/usr/bin/env bash
# Session 65, the short form of the GPU check for a budget too small for device_check_parallel.sh: GA's kernels
# (0061d2a: the fixed-maximum softcap's rounding correction per row) on the forward's test files, rounds 31 and 32,
# and the softcap / varlen / documents files (FILES overrides), eight pytest processes under one time limit (S,
# default 300 s).
#   carry [".prebuilt/pack/ga.tar.xz"]
TAG=s65c source "$(dirname "$0")/device_packs.sh" ga
use_pack GA
FILES=${FILES:-"tests/test_bug_reports_thirtysecond_gpu.py tests/test_bug_reports_thirtyfirst_gpu.py
  tests/test_softcap_accuracy_gpu.py tests/test_fwd_gpu.py tests/test_fwd_boundary_gpu.py tests/test_features_gpu.py
  tests/test_fwd_tiles_gpu.py tests/test_varlen_gpu.py tests/test_documents_gpu.py"}
pytest_log short "short check" ${S:-300} 8 --dist loadfile -rfE --junitxml="$OUT/short.xml" $FILES
