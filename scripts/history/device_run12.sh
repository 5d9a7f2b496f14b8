#!/usr/bin/env bash
# Session 6, call 3 (development): why did tests/test_tile_choice_cpu.py die with SIGSEGV in run 1 (device build),
# while the .so built here against torch 2.11 passed the same modules on the H200 (call 2)? Build on the device as
# gpu_check does, then the first C++ argument error alone, under cuda-gdb when it crashes; compiler and runtime facts.
set -u
export PYTHONPATH=$PWD
echo "== g++: $(/opt/gcc/bin/g++ --version | head -n 1); system: $(g++ --version 2>/dev/null | head -n 1)"
rm -rf build .fah_build flash_attn_hopper/_C*.so
FINAL=$OUT; OUT=/tmp/gcout FAH_SKIP_TESTS=1 FAH_SKIP_BENCH=1 bash scripts/gpu_check.sh > /tmp/gc.log 2>&1; OUT=$FINAL
cp flash_attn_hopper/_C.abi3.so $OUT/device_C.abi3.so
grep -E "^(build|sass|cutlass) " /tmp/gc.log | tail -n 3
ldd flash_attn_hopper/_C.abi3.so | grep -E "stdc|gcc_s|libc10|libm\.|libc\." 
python3 -c "import torch, sys; print(torch.__file__); import ctypes; print(open('/proc/self/maps').read().count('libstdc'))"
cat > /tmp/bad.py <<'PY'
import torch, flash_attn_hopper
f = torch.ops.flash_attn_hopper.fwd_block_m
print("ok call", f(64, 64, 8, 16, 2048, 2048, False, -1, -1, 132), flush=True)
try:
    f(60, 60, 8, 16, 128, 128, False, -1, -1, 132)
except RuntimeError as e:
    print("raised:", str(e).splitlines()[0], flush=True)
import re
maps = open("/proc/self/maps").read()
print(sorted(set(re.findall(r"\S*lib(?:stdc\+\+|gcc_s)\S*", maps))))
PY
timeout 60 python3 /tmp/bad.py; rc=$?; echo "standalone rc $rc"
if [[ $rc != 0 ]]; then
  timeout 120 cuda-gdb -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 /tmp/bad.py > $OUT/gdb.txt 2>&1
  grep -n -B2 -A30 "SIGSEGV" $OUT/gdb.txt | head -50
fi
TORCH_SHOW_CPP_STACKTRACES=0 timeout 60 python3 /tmp/bad.py > /dev/null 2>&1; echo "TORCH_SHOW_CPP_STACKTRACES=0 rc $?"
timeout 120 python3 -m pytest tests/test_tile_choice_cpu.py tests/test_autograd_cpu.py -q -x -p no:cacheprovider 2>&1 | tail -n 3
cp /tmp/gc.log $OUT/gc.log
