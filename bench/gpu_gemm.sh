#!/usr/bin/env bash
# The batched GEMM on the GPU machine, one call: for each set of compile-time defines in VARIANTS (';'-separated,
# the first the default build), the GEMM kernel tests, bench/gemm_accuracy.py (error against float64 and the GEMV
# as n_in grows) and bench/bench_gemm.py (time per launch at 512 and 4096 rows). Logs: $OUT/gemm_<n>_*.log.
#   VARIANTS=";NAME=VALUE OTHER=VALUE" bash bench/gpu_gemm.sh   (the default build, then one with those -D defines)
#   FIRST_TESTS_ONLY=1: the tests for the first variant only (the others timed and checked by gemm_accuracy.py)
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
out=${OUT:-/tmp}
n=0
IFS=';' read -ra variants <<< "${VARIANTS:-}"
[ ${#variants[@]} -eq 0 ] && variants=("")
for v in "${variants[@]}"; do
    echo "== defines: '${v}'"
    export STRATA_KERNEL_DEFINES="$v"
    if [ $n -eq 0 ] || [ -z "${FIRST_TESTS_ONLY:-}" ]; then
        python3 -m pytest -q -rs tests/test_cuda_kernels.py -k "gemm" 2>&1 | tee "$out/gemm_${n}_tests.log" \
            | grep -E "passed|failed|Error|assert" | tail -8
    fi
    python3 bench/gemm_accuracy.py 2>&1 | tee "$out/gemm_${n}_accuracy.log"
    python3 bench/bench_gemm.py --rows "${ROWS:-512,4096}" --reps 5 2>&1 | tee "$out/gemm_${n}_time.log"
    n=$((n + 1))
done
