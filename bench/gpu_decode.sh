#!/usr/bin/env bash
# Issue 13's decode under the 24 GiB budget in one GPU-machine call: the expert-kernel and mapped-token CUDA tests
# (stop if they fail) while the flash file is made (realistic mix and routing; it lasts while the machine stays
# warm), then bench_host.py's decode trace for each HostConfig.mapped_reads in MODES (default "fetch direct"),
# then, unless SAME_RUN=0, bench_vs_llamacpp.py's budget24 cells for Strata alone (fresh prompts: prefill 4096,
# decode at context 0 and 8192) with the first mode. Logs and traces go to $OUT.
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
model=models/flash-realistic.gguf
modes=${MODES:-fetch direct}
make_flash "$model"
python3 -m pytest -q -x -rs -m gpu tests/test_cuda_kernels.py -k "experts or moe or route" 2>&1 | tail -3 || exit 1
python3 -m pytest -q -rs -m gpu tests/test_cuda_backend.py -k "mapped or scheduler" 2>&1 | tee "$out/gpu_tests.log" | tail -4
wait
tail -1 "$out/make_model.log" 2>/dev/null
for m in $modes; do
    python3 bench/bench_host.py --model $model --backend cuda --vram-budget-gib 24 --tokens 64 --warmup 48 --preload \
        --mapped-reads "$m" --trace "$out/trace_$m.jsonl" 2>&1 | tee "$out/host_$m.log" | grep -v "^strata" | tail -30
done
if [ "${SAME_RUN:-1}" != 0 ]; then
    set -- $modes
    python3 bench/bench_vs_llamacpp.py --model $model --config budget24 --skip-llama --prefill 4096 --repeats 1 \
        --mapped-reads "$1" 2>&1 | tee "$out/bench_budget24.log" | grep -v "^ " | tail -30
fi
