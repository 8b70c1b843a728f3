#!/usr/bin/env bash
# Where a launch's warps wait, instruction by instruction: Nsight Compute's full set with its warp-state sampling on
# chosen launches, then the SASS page of each as CSV, summarized by bench/ncu_source.py (stall samples by opcode and
# reason, the hottest instructions). Firecracker machines only; clocks left alone (METHOD.md). Launches of
#   gemv (default): the GEMV phase (gpu_check.py --phases gemv --once: each flash matrix once, in GEMV_CASES order:
#        0 attn_qkv, 1 attn_gate, 2 ssm_out, 3 attn_q, 4 hc down, 5 router, 6 shexp gate+up, 7 shexp down, 8 LM head)
#   moe: the 16-pair expert tiles of a 512-row chunk (gpu_check.py --phases moe --moe-rows 512, flash geometry,
#        realistic skew; its eager pass first: 0 gate/up, 1 down)
#   bash bench/gpu_ncu_source.sh [moe] [launch ...]   (default 0 2 8; moe: 0 1)  -> $OUT/src_<n>.csv.xz,
#   $OUT/ncu_src_<n>.txt
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
kernels=regex:gemv_jobs run=(python3 bench/gpu_check.py --phases gemv --once) launches=(0 2 8)
if [ "${1:-}" = moe ]; then
    shift
    kernels='regex:moe_gu16|moe_down16' run=(python3 bench/gpu_check.py --phases moe --moe-rows 512) launches=(0 1)
fi
rc=0
for n in ${@:-${launches[@]}}; do
    rep="/tmp/ncu_src_$n"
    ncu --clock-control none -k "$kernels" --launch-skip "$n" --launch-count 1 --set full --import-source no \
        -f -o "$rep" "${run[@]}" > "$out/ncu_src_$n.log" 2>&1 || { rc=1; tail -5 "$out/ncu_src_$n.log"; continue; }
    ncu -i "$rep.ncu-rep" --page details > "$out/ncu_src_$n.txt" 2>&1
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "/tmp/src_$n.csv" 2>&1 || rc=1
    python3 bench/ncu_source.py "/tmp/src_$n.csv" | tee -a "$out/ncu_src_$n.txt" | head -60
    xz -T4 -c "/tmp/src_$n.csv" > "$out/src_$n.csv.xz"
    grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Eligible Warps|No Eligible|Executed Ipc A|DRAM Throughput|Warp Cycles Per Issued" "$out/ncu_src_$n.txt" | head -20
done
exit $rc
