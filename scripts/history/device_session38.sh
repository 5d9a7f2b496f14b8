#!/usr/bin/env bash
# Session 38, one call: a full build made on the CPU machine with the device's torch (carried in .prebuilt/pack as
# lower-case NAME.tar.xz, BUILD=NAME) through TEST_FILES (default: all of tests/; per-test hang guard, TEST_TIMEOUT),
# then the forward A/B of H2 (session 36's head build) and OTHERS (more carried builds) against it: dense bf16,
# head_dim AB_HD, both masks, 1024/4096/16384, ROUNDS rounds with the order reversed every other round
# (scripts/device_env_ab.sh). Call 8 ran BUILD=S2 TEST_TIMEOUT=350 AB_TIMEOUT=60 ROUNDS=2. The next-steps call of
# NOTES: BUILD=S2 OTHERS=E1 TEST_FILES="tests/test_sections_gpu.py tests/test_softcap_accuracy_gpu.py
# tests/test_varlen_gpu.py" ROUNDS=3 AB_HD=64,128 AB_TIMEOUT=300 (.prebuilt/pack on the CPU machine holds s2, a full
# build, and e1, a head_dim 64/128 bf16 one).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
B=${BUILD:?BUILD=NAME}
for p in h2 $(echo $B ${OTHERS:-} | tr A-Z a-z); do
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.prebuilt')" .prebuilt/pack/$p.tar.xz || exit 1
done
rm -f flash_attn_hopper/_C*.so; cp .prebuilt/$B/_C.abi3.so flash_attn_hopper/_C.abi3.so
timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -rs -p no:cacheprovider --timeout 150 --timeout-method thread ${TEST_FILES:-tests} \
  > $OUT/pytest_$B.log 2>&1
echo "tests rc $?"; grep -E "passed|failed" $OUT/pytest_$B.log | tail -n 2; grep -E "^FAILED" $OUT/pytest_$B.log | head
gzip -f $OUT/pytest_$B.log
CASES="H2;$(echo ${OTHERS:-} $B | tr ' ' ';')" DIRECTION=fwd ROUNDS=${ROUNDS:-2} TAG=s38 BACKENDS=ours \
  BENCH="--head-dims ${AB_HD:-64,128} --causal both --features dense --seqlens 1024,4096,16384 --no-check --no-adjacent" \
  timeout ${AB_TIMEOUT:-90} bash scripts/device_env_ab.sh > /dev/null
tar xzf $OUT/env_ab_s38.tar.gz -C /tmp
for b in ${OTHERS:-} $B; do python3 scripts/ab_compare.py /tmp/env_ab_s38 H2 $b; done
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv > $OUT/smi.txt
