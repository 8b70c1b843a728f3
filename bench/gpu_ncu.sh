#!/usr/bin/env bash
# Nsight Compute on the GEMV kernels at the flash shapes (gpu_check.py --phases gemv --once: each matrix's launch
# once, eagerly): throughput against the ceilings, warp stall reasons, memory traffic and occupancy per kernel.
# Firecracker machines only (ncu reads no counters under gVisor); clocks left alone (METHOD.md).
#   bash bench/gpu_ncu.sh [extra ncu arguments]      -> $OUT/ncu_gemv.txt (and the summary on stdout)
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
out=${OUT:-/tmp}
ncu --clock-control none --graph-profiling node -k 'regex:gemv_jobs|moe_gate_up|moe_down' \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section SchedulerStats \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' "$@" \
    python3 bench/gpu_check.py --phases gemv --once > "$out/ncu_gemv.txt" 2>&1
rc=$?
grep -E "gemv_jobs|moe_gate_up|moe_down|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Stall|stalled|Achieved Occupancy|Issue Slots Busy|Eligible Warps|No Eligible" "$out/ncu_gemv.txt" | head -300
exit $rc
