#!/usr/bin/env bash
# Tuning bench for gemv_q4.cu (scripts/device/q4lab.cu), one call on the GPU machine:
#   [LAB_QUICK=1] [NCU_K=regex:...] scripts/device/q4lab.sh [ncu]
# Builds q4lab with nvcc, runs it (ceilings, then each variant checked and timed), and with
# `ncu` profiles one launch of each variant under Nsight Compute (summary printed, the full
# report in $OUT/ncu.txt, the stall reasons per issued instruction listed). LAB_QUICK=1: only
# production and the by-chunk variants (T, TE). Without a GPU, scripts/cuda_toolchain.sh gives
# the same nvcc here: build q4lab.cu with the nvcc line below before spending a device call on it.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-$root/out}"
mkdir -p "$out"
cd "$root"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
nvcc -O3 -arch=sm_90 -std=c++17 --fmad=false -lineinfo -Xptxas -v -Ikernels/src/gpu \
    scripts/device/q4lab.cu -o /tmp/q4lab 2> "$out/ptxas.txt" || { cat "$out/ptxas.txt"; exit 1; }
# Registers and spills per kernel, one line each.
awk '/Compiling entry function/ {name=$0; sub(/.*function ./,"",name); sub(/. for.*/,"",name)}
     /Used [0-9]+ registers/ {print name ": " $0}' "$out/ptxas.txt" | sed 's/ptxas info *: //' | cut -c1-160
grep -i "spill" "$out/ptxas.txt" | grep -v " 0 bytes spill stores, 0 bytes spill loads" | head -20
/tmp/q4lab | tee "$out/q4lab.txt"
if [ "${1:-}" = ncu ]; then
    ncu --clock-control none -k "${NCU_K:-regex:gemv_q4|lab_}" \
        --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section SchedulerStats --section WarpStateStats \
        --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        /tmp/q4lab ncu > "$out/ncu.txt" 2>&1
    grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Active Warps Per|Eligible Warps" "$out/ncu.txt" | head -150
    grep -iE "error|warn" "$out/ncu.txt" | head -5
    # The stall reasons above 0.3 cycles per issued instruction, per kernel.
    awk '/^  [a-zA-Z_]+.*\(/ {print} /average_warps_issue_stalled/ && $NF+0 > 0.3 {sub(/smsp__average_warps_issue_stalled_/, "  stall "); print}' "$out/ncu.txt" | head -120
fi
if [ "${1:-}" = sass ]; then
    # Static opcode histogram of the named kernels (mangled-name substrings in $2, comma-separated).
    for k in ${2//,/ }; do
        cuobjdump -sass /tmp/q4lab | awk -v k="$k" '/Function :/ {on = index($0, k) > 0} on' > "$out/sass_$k.txt"
        echo "== $k: $(grep -c '/\*[0-9a-f]*\*/' "$out/sass_$k.txt") instructions"
        grep -oE '/\*[0-9a-f]{4}\*/ +[A-Z0-9_.]+' "$out/sass_$k.txt" | awk '{print $2}' | sed 's/\..*//' | sort | uniq -c | sort -rn | head -25 | tr '\n' ' '; echo
    done
    ncu --clock-control none -k "${3:-regex:lab_a}" --section InstructionStats --section ComputeWorkloadAnalysis \
        --section SpeedOfLight /tmp/q4lab ncu > "$out/ncu2.txt" 2>&1
    grep -E "^  [a-z_]+.*\(|Duration|DRAM Through|Executed Instructions  |Issued Instructions  |Issue Slots Busy|Executed Ipc A|SM Busy|Pipe" "$out/ncu2.txt" | head -80
fi
