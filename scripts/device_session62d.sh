#!/usr/bin/env bash
# Prepared in session 62, not run (six failed starts spent the device budget): on DQEF (the
# head's kernels), the thirtieth round's GPU file (it ran on the KVMC candidate build only), rounds 28 and 29, and the
# main forward, backward, documents and deterministic files, against the tree's Python. ~60-120 s after the start.
#   carry [".prebuilt/pack/dqef.tar.xz"]
TAG=s62d source "$(dirname "$0")/device_packs.sh" dqef
use_pack DQEF
pytest_log tests_s62d tests ${T_S:-300} 8 tests/test_bug_reports_thirtieth_gpu.py \
  tests/test_bug_reports_twentyninth_gpu.py tests/test_bug_reports_twentyeighth_gpu.py tests/test_fwd_gpu.py \
  tests/test_bwd_gpu.py tests/test_documents_gpu.py tests/test_deterministic_gpu.py
