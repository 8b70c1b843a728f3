#!/usr/bin/env bash
# Issue 12 on the GPU machine, one call: the CUDA tests, then the flash file (made here), then strata's prefill and
# decode on it through bench_vs_llamacpp.py (Strata's cells only: --skip-llama).
#   bash bench/gpu_batched.sh vram|budget24 [tests]
set -o pipefail
cd "$(dirname "$0")/.."
config=${1:?vram or budget24}; shift
source bench/gpu_env.sh || exit 1
if [ "${1:-}" = tests ]; then
    python3 -m pytest -q -rs -m gpu tests/test_cuda_kernels.py tests/test_cuda_backend.py 2>&1 | tail -15
fi
mkdir -p models
if [ ! -f models/flash.gguf ]; then
    python3 cli.py make-model models/flash.gguf --preset flash --ple-base 2000000 --threads 16 2>&1 | tail -1 || exit 1
fi
python3 bench/bench_vs_llamacpp.py --model models/flash.gguf --config "$config" --skip-llama \
    --prefill "${PREFILL:-512,4096}" --repeats "${REPEATS:-3}" --skip-strata "${SKIP:-}" 2>&1 \
    | tee "${OUT:-/tmp}/batched_$config.log"
