#!/usr/bin/env bash
# Nsight Compute (scripts/ncu_fwd.sh) of each prebuilt build in BUILDS (.prebuilt/NAME/_C.abi3.so, made on the CPU
# machine), one after another in one device call: $OUT/ncu_NAME.tar.gz per build. CASES and KERNEL as ncu_fwd.sh, e.g.
#   BUILDS="D_B H19" CASES="128 4096 deterministic bwd" KERNEL=flash_bwd_sm90_kernel bash scripts/device_ncu_prebuilt.sh
set -u
read -ra NAMES <<< "${BUILDS:?BUILDS=\"A B\"}"
for name in "${NAMES[@]}"; do
  cp -f .prebuilt/$name/_C.abi3.so flash_attn_hopper/_C.abi3.so || exit 1
  echo "== build $name"
  TAG=$name bash scripts/ncu_fwd.sh
done
