#!/usr/bin/env bash
# The all-VRAM whole-token graph under launch-only variants (STRATA_KERNEL_DEFINES words that change how the
# backend plans its launches, strata/kernels/build.py LAUNCH_ONLY: no kernel rebuild), one process each, on one
# model file, in one call: VARIANTS=";HC_DOWN_SLICES=3;MIX_OUT_SLICES=2;" (";"-separated, an empty one for the
# defaults: list it first and last to see the drift). Prints each variant's median ms/token (gpu_check.py's bench
# phase, positions 5-44, and after LONG_CTX tokens) and writes the fastest short-context variant to
# models/best_variant.txt for a later call on the same machine. MODEL (default models/flash-realistic.gguf) must
# exist. Logs go to $OUT.
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
model=${MODEL:-models/flash-realistic.gguf}
IFS=';' read -ra variants <<< "${VARIANTS:-;HC_DOWN_SLICES=3;}"
best="" best_ms=""
i=0
for v in "${variants[@]}"; do
    i=$((i + 1))
    log="$out/variant_$i.log"
    STRATA_KERNEL_DEFINES="$v" timeout "${TIMEOUT:-120}" python3 bench/gpu_check.py --phases bench \
        --long-ctx "${LONG_CTX:-256}" --model "$model" --routing realistic > "$log" 2>&1
    ms=$(grep -oP "positions 5-44: median \K[0-9.]+" "$log")
    long=$(grep -oP "positions [0-9]+\+: median \K[0-9.]+" "$log")
    echo "variant '$v': ${ms:-failed} ms/token at 5-44, ${long:-?} after ${LONG_CTX:-256}"
    [ -z "$ms" ] && { tail -3 "$log"; continue; }
    if [ -z "$best_ms" ] || awk "BEGIN{exit !($ms < $best_ms)}"; then best=$v best_ms=$ms; fi
done
echo "$best" > models/best_variant.txt
echo "fastest: '$best' ($best_ms ms/token)"
