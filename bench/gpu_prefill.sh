#!/usr/bin/env bash
# Issue 12's figures on the GPU machine in two calls (the flash file, realistic mix and routing, made here once:
# it lasts while the machine stays warm):
#   bash bench/gpu_prefill.sh vram       the GEMM tests (stop if they fail), the flash file made while the rest of
#                                        the CUDA tests run, bench_gemm.py, Strata's prefill and decode with every
#                                        weight in VRAM (bench_vs_llamacpp.py --skip-llama), a 4096-row chunk's stages
#   bash bench/gpu_prefill.sh budget24   the same prefill and decode under the 24 GiB budget, then bench_stream.py's
#                                        per-layer copy time and the share of it hidden behind compute (4096-row
#                                        chunks, streamed), with the collector's freeze and without
# PREFILL (default 512,4096,32768) and REPEATS (default 3) pass through; logs go to $OUT.
set -o pipefail
cd "$(dirname "$0")/.."
config=${1:?vram or budget24}
source bench/gpu_env.sh || exit 1
model=models/flash-realistic.gguf
mkdir -p models
make_model() {
    [ -f $model ] || python3 cli.py make-model $model --preset flash --ple-base 2000000 --routing realistic \
        --threads 12 > "$out/make_model.log" 2>&1
}
if [ "$config" = vram ]; then
    python3 -m pytest -q -x -rs -m gpu tests/test_cuda_kernels.py -k "gemm or experts or moe" 2>&1 | tail -3 || exit 1
    make_model &
    python3 -m pytest -q -rs -m gpu tests/test_cuda_kernels.py tests/test_cuda_backend.py 2>&1 | tee "$out/gpu_tests.log" \
        | tail -4
    python3 bench/bench_gemm.py --rows 512,4096 --reps 5 2>&1 | tee "$out/gemm.log"
    python3 bench/gemm_accuracy.py 2>&1 | tee "$out/gemm_accuracy.log"
    wait
else
    make_model
fi
tail -1 "$out/make_model.log" 2>/dev/null
python3 bench/bench_vs_llamacpp.py --model $model --config "$config" --skip-llama --prefill "${PREFILL:-512,4096,32768}" \
    --repeats "${REPEATS:-3}" 2>&1 | tee "$out/bench_$config.log" | grep -v "^ " | tail -30
if [ "$config" = vram ]; then
    python3 bench/bench_prefill_gpu.py --model $model --chunks 4096 --tokens 8192 2>&1 | tee "$out/stages.log" | tail -40
else
    for gc in on off; do              # the collector's freeze (Engine's default) against none
        python3 bench/bench_stream.py --model $model --tokens 8192 --step-tokens 4096 --modes always --all-layers \
            --gc-freeze $gc 2>&1 | tee "$out/stream_gc_$gc.log" | tail -52
    done
fi
