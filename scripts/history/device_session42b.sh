#!/usr/bin/env bash
# Session 42, call 5: the varlen spread diagnostic (scripts/varlen_spread.py) on the head's full build, 3 processes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" .prebuilt/pack/verify_so.tar.xz || exit 1
cp -f .prebuilt/VERIFY/_C.abi3.so flash_attn_hopper/_C.abi3.so
for r in 1 2 3; do
  echo "== process $r"; timeout 100 python3 scripts/varlen_spread.py ${SEQLEN:-1024} 128
done 2>&1 | tee $OUT/varlen_spread.txt
