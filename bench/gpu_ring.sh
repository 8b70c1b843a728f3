#!/usr/bin/env bash
# Why the experts' tile ring (branch expert-ring) loses in the whole-token graph, and whether another expert
# geometry wins on main, in one GPU-machine call: the all-VRAM whole-token graph (gpu_check.py --phases bench) on
# this tree with the time model's geometry and with GEOM (default 64,4/8,4), the ablate phase here (its "shared
# expert on the main stream" line times the token with nothing forked beside the experts), then the same on the
# ring's tree (RING=<folder>: `git archive expert-ring` unpacked under build/ and carried) and the ring capped at
# CTAS (default "132 200") CTAs. Steps run in that order, each under its own timeout, so a call cut short still
# returns the first ones. Logs to $OUT/ring_<n>_<label>.log; the lines that matter are echoed.
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
model=${MODEL:-models/flash-realistic.gguf}
ring=${RING:-build/ring}
make_flash "$model"
wait
[ -f "$model" ] || { tail -5 "$out/make_model.log"; exit 1; }
model=$(realpath "$model")
n=0
step() {   # step LABEL DIR ARGS...: gpu_check.py in DIR on the flash file
    local label=$1 dir=$2
    shift 2
    n=$((n + 1))
    echo "== $n: $label"
    (cd "$dir" && STRATA_CACHE="$PWD/.cache" timeout 200 python3 bench/gpu_check.py --model "$model" "$@") \
        > "$out/ring_${n}_$label.log" 2>&1
    grep -E "whole-token|token graph|decode_ms|without|main stream|near-empty|Error|error" \
        "$out/ring_${n}_$label.log" | head -20
}
step main . --phases bench --long-ctx 256
step main_geom . --phases bench --long-ctx 256 --expert-geom "${GEOM:-64,4/8,4}"
step main_ablate . --phases ablate
step ring_ablate "$ring" --phases ablate
for c in ${CTAS:-132 200}; do
    step "ring_ctas$c" "$ring" --phases bench --long-ctx 256 --expert-ctas "$c"
done
