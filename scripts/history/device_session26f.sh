#!/usr/bin/env bash
# Session 26 call 6: scripts/burst_vs_sustained.py on the carried build of the submitted kernels (.prebuilt/FINAL).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
cp -f .prebuilt/FINAL/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout 120 python3 scripts/burst_vs_sustained.py --cases 128:bwd,128:fwd,64:bwd 2>&1 | tee $OUT/burst_vs_sustained.txt
