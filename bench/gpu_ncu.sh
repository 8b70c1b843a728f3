#!/usr/bin/env bash
# Nsight Compute on the GEMV kernels at the flash shapes (gpu_check.py --phases gemv --once: each matrix's launch
# once, eagerly), or with `gemm` first on the batched GEMM (bench_gemm.py at 4096 rows: the first matrix's
# measured launch, attn_qkv IQ4_XS): throughput against the ceilings, warp stall reasons, memory traffic and
# occupancy per kernel, the tensor pipes' busy cycles; `moe`: the grouped expert GEMMs of gpu_check.py's moe phase
# (a 4096-row chunk's gate/up and down launches, flash geometry), `qsa`: qsa_attn of its qsa phase (4096 rows past
# the budget). Firecracker machines only (ncu reads no counters under gVisor); clocks left alone (METHOD.md).
#   bash bench/gpu_ncu.sh [gemm|moe|qsa] [extra ncu arguments]   -> $OUT/ncu_<mode>.txt (summary on stdout; gemv
#   without a mode)
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
case "${1:-}" in
    gemm)
        shift
        what=gemm kernels='regex:gemm_jobs' run=(python3 bench/bench_gemm.py --rows 4096 --reps 1)
        set -- --launch-skip 2 --launch-count 1 --section ComputeWorkloadAnalysis --section InstructionStats "$@" ;;
    moe)
        shift
        what=moe kernels='regex:moe_gu|moe_down' run=(python3 bench/gpu_check.py --phases moe)
        set -- --launch-count 2 --section ComputeWorkloadAnalysis --section InstructionStats "$@" ;;
    qsa)
        shift
        what=qsa kernels='regex:qsa_attn' run=(python3 bench/gpu_check.py --phases qsa)
        set -- --launch-count 1 --section ComputeWorkloadAnalysis --section InstructionStats "$@" ;;
    *)
        what=gemv kernels='regex:gemv_jobs|moe_gate_up|moe_down' run=(python3 bench/gpu_check.py --phases gemv --once) ;;
esac
ncu --clock-control none --graph-profiling node -k "$kernels" \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section SchedulerStats \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio|sm__pipe_tensor.*cycles_active\.avg\.pct_of_peak_sustained_active' \
    "$@" \
    "${run[@]}" > "$out/ncu_$what.txt" 2>&1
rc=$?
grep -E "gemv_jobs|gemm_jobs|moe_gate_up|moe_down|moe_gu|qsa_attn|pipe_tensor|Duration|Shared|Pipe|Issued|Executed Ipc|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Stall|stalled|Achieved Occupancy|Issue Slots Busy|Eligible Warps|No Eligible" "$out/ncu_$what.txt" | head -300
exit $rc
