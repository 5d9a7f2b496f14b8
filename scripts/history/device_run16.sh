#!/usr/bin/env bash
# Session 16's final device call (within ~9 minutes): the GPU check from a clean build (scripts/history/device_run4.sh),
# then the head_dim 128 forward in fp16 and bf16 with cuDNN beside ours (issue 6's fp16 criterion: is cuDNN's
# fp16/bf16 ratio the same as ours?); those JSONs come back as fp16_bf16_cudnn.tar.gz.
set -u
mkdir -p /tmp/fp
rm -f flash_attn_hopper/_C*.so
CHECK_TIMEOUT=${CHECK_TIMEOUT:-450} bash scripts/history/device_run4.sh
for dt in fp16 bf16; do
  timeout 60 python3 -m flash_attn_hopper.benchmark --dtype $dt --head-dims 128 --seqlens 4096,16384 --features dense \
    --direction fwd --backends ours,cudnn --no-check --no-bar --json /tmp/fp/fwd_$dt.json 2>&1 | grep "^| " | cut -d'|' -f2-9
done
(cd /tmp/fp && ls *.json > /dev/null 2>&1 && tar czf $OUT/fp16_bf16_cudnn.tar.gz *.json)
