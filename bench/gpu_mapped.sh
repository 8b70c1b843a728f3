#!/usr/bin/env bash
# The 24 GiB mapped decode under several settings, in one GPU-machine call: the flash file (realistic mix and
# routing) made if missing, then bench_host.py under the 24 GiB budget with every expert preloaded into host
# memory (decode tokens run mapped), once per entry of RUNS: "mapped-reads|STRATA_KERNEL_DEFINES" entries separated
# by ';' (default: fetch, prefetch). With VRAM_VARIANTS set (";"-separated defines, as gpu_allvram.sh's VARIANTS),
# the all-VRAM whole-token bench (gpu_check.py --phases bench) runs first for each. Logs in $OUT.
#   RUNS="fetch|;prefetch|;prefetch|PREFETCH_RESERVE=1" TOKENS=48 bash bench/gpu_mapped.sh
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
model=${MODEL:-models/flash-realistic.gguf}
make_flash "$model"
wait
[ -f "$model" ] || { tail -5 "$out/make_model.log"; exit 1; }
echo "model ready at ${SECONDS} s"
if [ -n "${VRAM_VARIANTS+x}" ]; then
    IFS=';' read -ra variants <<< "$VRAM_VARIANTS"
    [ ${#variants[@]} -eq 0 ] && variants=("")
    for v in "${variants[@]}"; do
        echo "== all-VRAM, STRATA_KERNEL_DEFINES='$v'"
        STRATA_KERNEL_DEFINES="$v" python3 bench/gpu_check.py --phases bench --long-ctx 1024 --model "$model" \
            --routing realistic 2>&1 | tee -a "$out/bench.log" | grep -E "^decode"
    done
fi
IFS=';' read -ra runs <<< "${RUNS:-fetch|;prefetch|}"
for i in "${!runs[@]}"; do
    reads=${runs[$i]%%|*}; defs=${runs[$i]#*|}
    echo "== 24 GiB, --mapped-reads $reads, STRATA_KERNEL_DEFINES='$defs' (${SECONDS} s)"
    STRATA_KERNEL_DEFINES="$defs" timeout "${HOST_S:-150}" python3 bench/bench_host.py --model "$model" \
        --backend cuda --vram-budget-gib 24 --preload --tokens "${TOKENS:-48}" --mapped-reads "$reads" \
        > "$out/mapped_$i.log" 2>&1
    grep -E "^(preload|decode|VRAM expert|host overhead)|prefetch|mapped" "$out/mapped_$i.log" | head -12
    grep -E "Error" "$out/mapped_$i.log" | head -3
done
echo "total ${SECONDS} s"
exit 0
