#!/usr/bin/env bash
# Issue 16 on the GPU machine: the tier benchmark (bench_tiers.py) cold, CUDA backend, 24 GiB VRAM budget, on a file
# made here (the disk holds one flash file at a time: the others are deleted first). Logs and JSON to $OUT.
#   bash bench/gpu_tiers.sh realistic|uniform [budgets, default 8,16,32]
#   bash bench/gpu_tiers.sh ple          (flash's 4 first layers' geometry with the full 28.8 GB PLE table)
#   PLE_LAYERS=48 PLE_EXPERTS=64 bash bench/gpu_tiers.sh ple   (all 48 layers, fewer experts so that the file fits
#                                        the disk: a prompt chunk computes as long as flash's, its PLE rows from disk)
# Env: TOKENS (decode tokens measured, 32), WARMUP (warm-up tokens, 24), PREFILL (prompt tokens, 512), STEP (rows a
# step, 512), RAW (reads per raw disk measurement, 1000; 0 skips them), PREFETCH (off, previous or router).
set -o pipefail
cd "$(dirname "$0")/.."
what=${1:?realistic, uniform or ple}
budgets=${2:-8,16,32}
source bench/gpu_env.sh || exit 1
mkdir -p models
case $what in
    realistic|uniform) model=models/flash-$what.gguf ;;
    ple) layers=${PLE_LAYERS:-4}; experts=${PLE_EXPERTS:-512}
         model=models/flash-ple-L$layers-E$experts.gguf; budgets=${2:-all} ;;
    *) echo "unknown: $what"; exit 2 ;;
esac
for f in models/flash*.gguf; do [ -f "$f" ] && [ "$f" != "$model" ] && rm -f "$f"; done
if [ ! -f $model ]; then
    t0=$(date +%s)
    if [ $what = ple ]; then
        python3 -c "from strata.model.synth import make_model; make_model('flash', '$model', overrides={'n_layer': $layers, 'n_expert': $experts})" \
            2>&1 | tail -1 || exit 1
    else
        python3 cli.py make-model $model --preset flash --ple-base 2000000 --routing $what 2>&1 | tail -1 || exit 1
    fi
    echo "made $model in $(( $(date +%s) - t0 )) s: $(du -h $model | cut -f1)"
fi
python3 bench/bench_tiers.py --model $model --backend cuda --vram-budget-gib 24 --host-budgets "$budgets" \
    --tokens "${TOKENS:-32}" --warmup "${WARMUP:-24}" --raw-reads "${RAW:-1000}" --prefill "${PREFILL:-512}" --prefetch "${PREFETCH:-off}" --step-tokens "${STEP:-512}" \
    --json "${OUT:-/tmp}/tiers_$what.json" 2>&1 | tee "${OUT:-/tmp}/tiers_$what.log"
