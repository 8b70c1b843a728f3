#!/usr/bin/env bash
# Every kernel node of the all-VRAM whole-token graph timed by Nsight Compute (one node at a time, clocks and
# caches left alone), summed by kernel and grid: where a token's milliseconds go. Makes models/flash.gguf when
# missing (gpu_check.py's model phase). Each node is timed alone, so its ramp counts in full: with programmatic
# dependent launch the graph takes less than the sum (7.55 against 8.45 ms on the H200, 2026-12-03).
# Firecracker machines only (ncu reads no counters under gVisor).
#   bash bench/gpu_profile.sh [tokens]      -> $OUT/ncu_token.csv, $OUT/profile.log; the table on stdout
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
tokens=${1:-1}
mopt=(--model "${MODEL:-models/flash.gguf}")       # MODEL: another flash file (made with uniform routing if missing)
python3 bench/gpu_check.py --phases model "${mopt[@]}" > "$out/profile.log" 2>&1 || { tail -5 "$out/profile.log"; exit 1; }
ncu --profile-from-start off --graph-profiling node --clock-control none --cache-control none --csv --page raw \
    --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread --log-file "$out/ncu_token.csv" \
    python3 bench/gpu_check.py --phases profile --tokens "$tokens" "${mopt[@]}" >> "$out/profile.log" 2>&1
rc=$?
# the graph's own ms/token under ncu is not the native one (the tool slows every launch, 54-56 ms a token on the
# H200): compare the kernels' sum with gpu_check.py's bench phase, run without the tool
python3 bench/ncu_table.py "$out/ncu_token.csv" --tokens "$tokens" | head -70
exit $rc
