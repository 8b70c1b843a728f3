#!/usr/bin/env bash
# The batched GEMM on the GPU machine, one call: for each set of compile-time defines in VARIANTS (';'-separated,
# the first the default build), the GEMM kernel tests, bench/gemm_accuracy.py (error against float64 and the GEMV
# as n_in grows) and bench/bench_gemm.py (time per launch at 512 and 4096 rows). Logs: $OUT/gemm_<n>_*.log.
#   VARIANTS=";NAME=VALUE OTHER=VALUE" bash bench/gpu_gemm.sh   (the default build, then one with those -D defines)
#   FIRST_TESTS_ONLY=1: the tests and gemm_accuracy.py for the first variant only (the others timed)
#   ALL_TESTS=1: the first variant's tests are every CUDA test (tests/test_cuda_kernels.py, tests/test_cuda_backend.py),
#   not only the GEMM ones, run while the model file is made
#   MODEL=models/flash-realistic.gguf: also a 4096-row prefill chunk of that file per variant, stage by stage and as
#   the whole-step graph (bench_prefill_gpu.py; the file is made first when missing: flash preset, realistic mix
#   and routing, ~2 minutes); LAUNCHES=N: the first variant's chunk also launch by launch, the N largest printed
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
[ -n "${MODEL:-}" ] && make_flash "$MODEL"
n=0
IFS=';' read -ra variants <<< "${VARIANTS:-}"
[ ${#variants[@]} -eq 0 ] && variants=("")
for v in "${variants[@]}"; do
    echo "== defines: '${v}' (at ${SECONDS} s)"
    export STRATA_KERNEL_DEFINES="$v"
    if [ $n -eq 0 ] || [ -z "${FIRST_TESTS_ONLY:-}" ]; then
        if [ $n -eq 0 ] && [ -n "${ALL_TESTS:-}" ]; then
            python3 -m pytest -q -rs -m gpu tests/test_cuda_kernels.py 2>&1 | tee "$out/kernel_tests.log" \
                | grep -E "FAILED|Error|passed|failed" | tail -25
            python3 -m pytest -q -rs -m gpu tests/test_cuda_backend.py 2>&1 | tee "$out/gpu_tests.log" \
                | grep -E "FAILED|Error|passed|failed" | tail -12
        else
            python3 -m pytest -q -rs -m gpu tests/test_cuda_kernels.py -k "gemm or grouped" 2>&1 \
                | tee "$out/gemm_${n}_tests.log" | grep -E "passed|failed|Error|assert" | tail -8
        fi
    fi
    if [ $n -eq 0 ] || [ -z "${FIRST_TESTS_ONLY:-}" ]; then
        python3 bench/gemm_accuracy.py 2>&1 | tee "$out/gemm_${n}_accuracy.log"
    fi
    python3 bench/bench_gemm.py --rows "${ROWS:-512,4096}" --reps 5 2>&1 | tee "$out/gemm_${n}_time.log"
    if [ -n "${MODEL:-}" ]; then
        wait                          # the model file, when it is being made
        python3 bench/bench_prefill_gpu.py --model "$MODEL" --chunks 4096 --tokens 8192 \
            $([ $n -eq 0 ] && echo "--launches ${LAUNCHES:-0}") 2>&1 \
            | tee "$out/gemm_${n}_prefill.log" | grep -E "^chunk|^    "
    fi
    n=$((n + 1))
done
