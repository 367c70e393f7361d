#!/bin/bash
# sm_count.cu's kernels on 132, 66 and 44 SMs, each beside nvidia-smi sampling every 50 ms; the mean of
# the samples after the first quarter (the clock settled). "above 125 W": the idle power energy.py measured.
#     bash records/2026-12-04_H200_energy_costs/sm_count.sh
cd "$(dirname "$0")"
nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a sm_count.cu -o /tmp/sm_count || exit 1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv
meas() {
  nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 50 > /tmp/smi.txt &
  p=$!; sleep 0.3
  r=$(/tmp/sm_count "$@")
  kill $p; wait $p 2>/dev/null
  awk -F, -v r="$r" '{c[NR]=$1; w[NR]=$2} END {n=0; cs=0; ws=0; for (i=int(NR/4)+1;i<=NR;i++){n++; cs+=c[i]; ws+=w[i]}; split(r, f, " "); printf "%s  %4.0f MHz %4.0f W", r, cs/n, ws/n; tb=f[7]; printf "  %5.1f mJ/GB (%.1f above 125 W)\n", (ws/n)/tb, (ws/n-125)/tb}' /tmp/smi.txt
}
for k in 132 66 44; do meas copy $k 3; done
CONST=1 meas copy 132 3
for k in 132 66; do meas sum $k 3; done
for k in 132 66; do meas norm $k 3; done
