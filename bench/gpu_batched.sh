#!/usr/bin/env bash
# Issue 12 on the GPU machine, one call: the CUDA tests, then the flash file (made here), then strata's prefill and
# decode on it through bench_vs_llamacpp.py (--skip-llama unless .llama/llama-bench.xz was carried).
#   bash bench/gpu_batched.sh vram|budget24 [tests]
set -o pipefail
cd "$(dirname "$0")/.."
config=${1:?vram or budget24}; shift
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 STRATA_CACHE="$PWD/.cache"
if [ "${1:-}" = tests ]; then
    python3 -m pytest -q -rs tests/test_cuda_kernels.py tests/test_cuda_backend.py 2>&1 | tail -15
fi
mkdir -p models
if [ ! -f models/flash.gguf ]; then
    python3 cli.py make-model models/flash.gguf --preset flash --ple-base 2000000 --threads 16 2>&1 | tail -1 || exit 1
fi
python3 bench/bench_vs_llamacpp.py --model models/flash.gguf --config "$config" --skip-llama \
    --prefill "${PREFILL:-512,4096}" --repeats "${REPEATS:-3}" --skip-strata "${SKIP:-}" 2>&1 \
    | tee "${OUT:-/tmp}/batched_$config.log"
