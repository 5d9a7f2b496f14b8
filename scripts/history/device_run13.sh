#!/usr/bin/env bash
# Session 6, call 4 (development, ~3 min): a head_dim 128 fp16+bf16 build on the device with the -lstdc++ link fix
# (is libstdc++ a shared dependency now, with the image's g++ wrapper?), the linkage / argument-error / softcap tests,
# and the softcap A/B: bf16 now computes tanh with tanh.approx.f32 (one MUFU op), fp16 keeps the exact formula
# (two), so fp16 is this run's control; softcap against dense per dtype at head_dim 128.
set -u
export PYTHONPATH=$PWD
echo "== /opt/gcc/bin/g++: $(file -b /opt/gcc/bin/g++ 2>/dev/null | cut -c1-60)"; grep -a -o -E "static-lib[a-z+]*|-l[a-z+]+" /opt/gcc/bin/g++ 2>/dev/null | sort | uniq -c | head
rm -rf build .fah_build flash_attn_hopper/_C*.so
OUT=/tmp/gcout FAH_HDIMS=128 FAH_DTYPES=fp16,bf16 FAH_SKIP_TESTS=1 FAH_SKIP_BENCH=1 bash scripts/gpu_check.sh > /tmp/gc.log 2>&1
grep -E "^(build|sass) " /tmp/gc.log; grep -E "lstdc|Error" /tmp/gcout/build.log 2>/dev/null | grep -v nvcc | head -3
readelf -d flash_attn_hopper/_C.abi3.so | grep NEEDED | grep -o "lib[^]]*" | tr '\n' ' '; echo
timeout 240 python3 -m pytest tests/test_linkage_cpu.py tests/test_tile_choice_cpu.py tests/test_features_gpu.py -q -rs -p no:cacheprovider -k "linkage or tile_choice or softcap or lse" > $OUT/pytest_ab.log 2>&1
echo "pytest rc $?"; grep -E "passed|failed|FAILED|Error" $OUT/pytest_ab.log | tail -n 8
for dt in bf16 fp16; do
  timeout 120 python3 -m flash_attn_hopper.benchmark --dtype $dt --head-dims 128 --seqlens 4096,16384 --features dense,softcap \
    --backends ours --no-check --no-bar --json $OUT/ab_$dt.json > $OUT/ab_$dt.log 2>&1
  echo "== $dt rc $?"; grep -E "^\| (dense|softcap) " $OUT/ab_$dt.log | head -n 8
done
cp /tmp/gc.log $OUT/gc.log
