#!/usr/bin/env bash
# One device call: build once, a hang-guarded forward smoke test of the persistent kernel (falls back to
# FAH_FWD_PERSISTENT=0 for the rest if it fails), the GPU check on that build (SASS, tests, benchmark), a forward
# A/B of persistent vs one CTA per tile, the host-overhead probe and train_lm. Results within 8 files in $OUT.
set -u
FINAL=$OUT
export OUT=/tmp/gc
mkdir -p $OUT
rm -f flash_attn_hopper/_C*.so; rm -rf build .fah_build
FAH_SKIP_TESTS=1 FAH_SKIP_BENCH=1 bash scripts/gpu_check.sh > /tmp/build.out 2>&1
tail -n 5 /tmp/build.out
cp .fah_build/gpu_check/build.log /tmp/build.log 2>/dev/null
export PYTHONPATH=$PWD:$PWD/.fah_build/site:${PYTHONPATH:-}
if ! timeout 90 python3 scripts/smoke_fwd.py > $OUT/smoke.txt 2>&1; then
  echo "SMOKE FAILED (rc $?): persistent forward off for the rest"; tail -5 $OUT/smoke.txt; export FAH_FWD_PERSISTENT=0
fi
grep -c "nan 0" $OUT/smoke.txt
FAH_PREBUILT=1 FAH_BUILD_LOG=/tmp/build.log bash scripts/gpu_check.sh > /tmp/gpu_check.out 2>&1
tail -n 75 /tmp/gpu_check.out | grep -v "^| dense | \(64\|256\)"
FAH_FWD_PERSISTENT=0 timeout 120 python3 -m flash_attn_hopper.benchmark --direction fwd --backends ours --no-check \
  --no-bar --features dense,window,softcap --json $OUT/ab_nonpersistent.json > $OUT/ab.log 2>&1
grep "^| " $OUT/ab.log | head -60 > $FINAL/ab_nonpersistent.txt
timeout 60 python3 scripts/host_overhead.py > $FINAL/host.txt 2>&1; cat $FINAL/host.txt
timeout ${TRAIN_TIMEOUT:-150} python3 examples/train_lm.py ${TRAIN_ARGS:-} --json $OUT/train_lm.json > $OUT/train_lm.log 2>&1
tail -n 8 $OUT/train_lm.log | tee $FINAL/train_lm.txt
for f in summary.txt pytest.log kernels.txt bench_attention.json bench_extra.tar.gz; do cp -f $OUT/$f $FINAL/ 2>/dev/null; done
tar -czf $FINAL/misc.tar.gz -C $OUT junit.xml train_lm.json train_lm.log smoke.txt ab.log ab_nonpersistent.json -C /tmp build.log 2>/dev/null
ls $FINAL
