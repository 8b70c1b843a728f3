#!/usr/bin/env bash
# A same-machine A/B of the 24 GiB path in one GPU-machine call: this tree against another tree of the repository
# (BASE=<folder>: `git archive <commit>` unpacked under build/ and carried), alternately in ORDER (default "new
# base"), each `bench_vs_llamacpp.py --config budget24 --skip-llama` on the same flash file with ARGS (default
# "--prefill 4096 --repeats 1 --decode 128": long enough a decode for the cache's promotions to settle). The CUDA
# backend's GPU tests first (TESTS="" skips them; TESTS=<pytest -k expression> picks them) while the file is made
# (MODEL, default models/flash-realistic.gguf with the calibrated routing), then the pinned-memory reader's rate
# of this host (gpu_check.py's overlap phase: a mapped token's misses move at it). Logs to $OUT/ab_<n>_<tree>.log.
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
model=${MODEL:-models/flash-realistic.gguf}
base=${BASE:?BASE=<folder of the other tree>}
mkdir -p models "$base/models"
make_pid=
if [ ! -f "$model" ]; then
    make_flash "$model"
    make_pid=$!
fi
tests=${TESTS-streamed or mapped or scheduler or lent or host_cache or writes_only}
if [ -n "$tests" ]; then
    python3 -m pytest -q -rs -m gpu tests/test_cuda_backend.py -k "$tests" > "$out/gpu_tests.log" 2>&1
    grep -E "FAILED|passed|failed" "$out/gpu_tests.log" | tail -8
fi
if [ -n "$make_pid" ]; then
    wait $make_pid || { tail -5 "$out/make_model.log"; exit 1; }
fi
ln -sfn "$(realpath "$model")" "$base/$model"
read -ra args <<< "${ARGS:---prefill 4096 --repeats 1 --decode 128}"
n=0
for tree in ${ORDER:-new base}; do
    n=$((n + 1))
    dir=.
    [ "$tree" = base ] && dir=$base
    echo "== $n: $tree"
    (cd "$dir" && python3 bench/bench_vs_llamacpp.py --model "$model" --config budget24 --skip-llama "${args[@]}") \
        > "$out/ab_${n}_$tree.log" 2>&1
    grep -E "^\| (prefill|decode)|^strata (decode|prefill) [0-9]+:|VRAM slots|graph" "$out/ab_${n}_$tree.log" | head -24
done
python3 bench/gpu_check.py --phases overlap --model "$model" --routing realistic 2>&1 \
    | grep -E "reader (264|16) CTAs: alone" | tee "$out/overlap.log"
