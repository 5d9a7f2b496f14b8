#!/usr/bin/env bash
# A build of the committed tree (plus optional patches) made on the CPU machine for the device, packed as
# .prebuilt/pack/<stem>.tar.xz holding NAME/_C.abi3.so (stripped) and NAME/build.log (the ptxas report), the layout
# that scripts/device_check_parallel.sh (PREBUILT=NAME PACK=stem) and scripts/device_env_ab.sh read. A carried pack
# saves the device build (~2 minutes of a 30-minute device budget) and lets one call A/B several builds.
# Why a venv with torch 2.11.0: the device's torch (2.11.0+cu130); an extension built against another torch may not
# load there. Built on Debian 12 the .so needs GLIBC 2.32 at most (printed below), older than the device image's, so
# it loads there (session 50: WRDV's pack loaded on the device's Python 3.12 image and passed the GPU check).
#   NAME=HEAD bash scripts/build_pack.sh
#   NAME=WRDV PATCHES="a.patch b.patch" FAH_HDIMS=128 FAH_DTYPES=bf16 bash scripts/build_pack.sh
# Environment: NAME (required), STEM (default: NAME in lower case), PATCHES (applied in order to a `git archive` of
#   REV, default HEAD), VENV (default /tmp/v211: made with torch==2.11.0, ninja, setuptools, wheel, numpy and the
#   CUTLASS wheel of .whl/ when missing), MAX_JOBS (default the core count), FAH_HDIMS / FAH_DTYPES (narrow builds).
# Full build on the 2-core CPU machine: ~9 minutes; head_dim 64 bf16 alone: under 2.
set -euo pipefail
: "${NAME:?NAME=build name}"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STEM=${STEM:-$(echo "$NAME" | tr 'A-Z' 'a-z')}
VENV=${VENV:-/tmp/v211}
if ! "$VENV/bin/python" -c "import torch, cutlass_library" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.11.0 ninja setuptools wheel numpy "$ROOT"/.whl/nvidia_cutlass-*.whl
fi
SRC=$(mktemp -d /tmp/build_pack.XXXXXX)
git -C "$ROOT" archive "${REV:-HEAD}" | tar -x -C "$SRC"
for p in ${PATCHES:-}; do (cd "$SRC" && patch -p1 --no-backup-if-mismatch < "$(cd "$ROOT" && realpath "$p")"); done
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$VENV/bin:$CUDA_HOME/bin:$PATH"
(cd "$SRC" && MAX_JOBS=${MAX_JOBS:-$(nproc)} FAH_PTXAS_VERBOSE=1 "$VENV/bin/python" setup.py build_ext --inplace \
  --build-temp .fah_build/build_temp > build.log 2>&1) || { tail -n 30 "$SRC/build.log"; exit 1; }
STAGE=$(mktemp -d /tmp/build_pack_stage.XXXXXX)
mkdir -p "$STAGE/$NAME" "$ROOT/.prebuilt/pack"
cp "$SRC/flash_attn_hopper/_C.abi3.so" "$SRC/build.log" "$STAGE/$NAME/"
strip --strip-unneeded "$STAGE/$NAME/_C.abi3.so"
newest=$(objdump -T "$STAGE/$NAME/_C.abi3.so" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -n 1)
echo "$NAME: needs $newest at most (the device's Python 3.12 image must have it)"
tar cJf "$ROOT/.prebuilt/pack/$STEM.tar.xz" -C "$STAGE" "$NAME"
grep "spill stores" "$SRC/build.log" | grep -v " 0 bytes spill stores" | sort | uniq -c || echo "no spills"
ls -la "$ROOT/.prebuilt/pack/$STEM.tar.xz"
rm -rf "$SRC" "$STAGE"
