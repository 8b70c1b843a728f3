#!/usr/bin/env bash
# Nsight Compute on the GEMV kernels at the flash shapes (gpu_check.py --phases gemv --once: each matrix's launch
# once, eagerly), or with `gemm` first on the batched GEMM (bench_gemm.py at 4096 rows: the first matrix's
# measured launch, attn_qkv IQ4_XS): throughput against the ceilings, warp stall reasons, memory traffic and
# occupancy per kernel. Firecracker machines only (ncu reads no counters under gVisor); clocks left alone
# (METHOD.md).
#   bash bench/gpu_ncu.sh [gemm] [extra ncu arguments]      -> $OUT/ncu_gemv.txt or ncu_gemm.txt (summary on stdout)
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
out=${OUT:-/tmp}
if [ "${1:-}" = gemm ]; then
    shift
    what=gemm kernels='regex:gemm_jobs' run=(python3 bench/bench_gemm.py --rows 4096 --reps 1)
    set -- --launch-skip 2 --launch-count 1 --section ComputeWorkloadAnalysis --section InstructionStats "$@"
else
    what=gemv kernels='regex:gemv_jobs|moe_gate_up|moe_down' run=(python3 bench/gpu_check.py --phases gemv --once)
fi
ncu --clock-control none --graph-profiling node -k "$kernels" \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section SchedulerStats \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' "$@" \
    "${run[@]}" > "$out/ncu_$what.txt" 2>&1
rc=$?
grep -E "gemv_jobs|gemm_jobs|moe_gate_up|moe_down|Duration|Shared|Pipe|Issued|Executed Ipc|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Stall|stalled|Achieved Occupancy|Issue Slots Busy|Eligible Warps|No Eligible" "$out/ncu_$what.txt" | head -300
exit $rc
