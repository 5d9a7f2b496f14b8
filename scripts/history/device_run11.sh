#!/usr/bin/env bash
# Session 6, call 2 (development): a carried .so (built here against torch 2.11, FAH_PREBUILT) runs
#  1. the segfault hunt: tests/test_tile_choice_cpu.py crashed (SIGSEGV) at its first C++ argument error in run 1,
#     after the GPU modules; each candidate module then tile_choice, in separate processes, until one crashes;
#     the crashing pair again under cuda-gdb for the native backtrace;
#  2. the test modules that run 1 never reached (after the crash);
#  3. scripts/step_times.py (issue 4: wall vs GPU vs host issue time per step, syncs, mallocs, launches).
set -u
export PYTHONPATH=$PWD
cp .prebuilt/_C.abi3.so flash_attn_hopper/_C.abi3.so && ls -la flash_attn_hopper/_C*.so || exit 1
T=tests/test_tile_choice_cpu.py
crashed=""
for prior in "" tests/test_nightly_cpu.py tests/test_compile_gpu.py "tests/test_fwd_gpu.py tests/test_head_dims_gpu.py" \
             "tests/test_deterministic_gpu.py tests/test_features_gpu.py tests/test_fwd_tiles_gpu.py tests/test_head_dim_v_gpu.py tests/test_mask_math_cpu.py tests/test_reference_cpu.py"; do
  timeout 300 python3 -m pytest $prior $T -q -x -p no:cacheprovider > /tmp/hunt.log 2>&1
  rc=$?
  echo "== prior [$prior]: rc $rc; $(tail -n 1 /tmp/hunt.log)"
  if [[ $rc == 139 || $rc == 134 ]]; then crashed="$prior"; cp /tmp/hunt.log $OUT/hunt_crash.log; break; fi
done
if [[ -n $crashed || $rc == 139 ]]; then
  timeout 300 cuda-gdb -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 -m pytest $crashed $T -q -x -p no:cacheprovider > $OUT/gdb.txt 2>&1
  grep -n -A40 "SIGSEGV" $OUT/gdb.txt | head -60
fi
echo "== modules after the crash point in run 1"
timeout 200 python3 -m pytest tests/test_tile_choice_cpu.py tests/test_transformers_cpu.py tests/test_transformers_gpu.py \
  tests/test_validation_cpu.py tests/test_varlen_gpu.py -q -rs -p no:cacheprovider > $OUT/pytest_rest.log 2>&1
echo "rc $?"; tail -n 5 $OUT/pytest_rest.log
echo "== step_times"
timeout 150 python3 scripts/step_times.py --rounds 2 --steps 60 2>&1 | grep -v Warning | tee $OUT/step_times.txt | tail -n 8
