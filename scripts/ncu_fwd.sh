#!/usr/bin/env bash
# Nsight Compute on the forward kernel for each "HEAD_DIM SEQLEN MODE [causal]" case in $CASES (';'-separated):
# the details page (speed of light, pipe utilisation, warp states, instruction mix) and the SASS source page (stall
# samples per instruction) as text, tarred into $OUT/ncu_$TAG.tar.gz. Needs the extension built in the tree.
# A case ending in "bwd" profiles the backward's main kernel instead (KERNEL=flash_bwd_sm90_kernel).
set -u
TAG=${TAG:-fwd}
D=/tmp/ncu_$TAG; mkdir -p $D
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
IFS=';' read -ra cases <<< "${CASES:-128 16384 dense;128 16384 softcap}"
for c in "${cases[@]}"; do
  name=$(echo $c | tr ' ' '_')
  PYTHONPATH=$PWD timeout ${NCU_TIMEOUT:-120} $NCU --clock-control none --profile-from-start off --set full \
    -k regex:${KERNEL:-flash_fwd_sm90_kernel} -c 1 -f -o $D/$name python3 scripts/ncu_fwd.py $c > $D/$name.log 2>&1
  echo "$c: ncu rc $?"
  $NCU -i $D/$name.ncu-rep --page details --print-details all > $D/${name}_details.txt 2>&1
  $NCU -i $D/$name.ncu-rep --page source --csv --print-source sass > $D/${name}_sass.csv 2>&1
  grep -E "Duration|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc Active|No Eligible|Warp Cycles Per Issued" \
    $D/${name}_details.txt | head -n 12
  rm -f $D/$name.ncu-rep
done
tar czf $OUT/ncu_$TAG.tar.gz -C /tmp ncu_$TAG
