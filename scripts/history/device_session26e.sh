#!/usr/bin/env bash
# Session 26 call 5: SM clock and board power per implementation (scripts/clock_power.py) on a build of the submitted
# kernels made on the CPU machine (.prebuilt/FINAL, session 25's full build of bce33dd, whose code differs from the
# head's in comments only; from .prebuilt/pack/p.tar.xz): bf16 at head_dim 64/128/256 non-causal 16384, forward and
# backward, ours / cuDNN / FA2, two rounds; then fp16 at head_dim 128 against cuDNN.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD  # (the call ran with PYTHONPATH exported by the command line)
python3 -c "import tarfile; tarfile.open('.prebuilt/pack/p.tar.xz').extractall('.prebuilt')" || exit 1
cp -f .prebuilt/FINAL/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${CP_TIMEOUT:-240} python3 scripts/clock_power.py --json $OUT/clock_power_bf16.json
timeout 90 python3 scripts/clock_power.py --dtype fp16 --cases 128:no:fwd,128:no:bwd --backends ours,cudnn \
  --json $OUT/clock_power_fp16.json
