#!/usr/bin/env bash
# The batched step's routed experts on the GPU machine, one call: for each set of compile-time defines in VARIANTS
# (';'-separated, the first the default build), the grouped-expert and GEMM kernel tests in that build (the first
# variant also runs the backend's GPU tests), bench/gpu_check.py's moe phase (moe_group and each grouped launch over
# a 4096-row chunk, flash geometry, realistic skew), and with MODEL set a 4096-row prefill chunk of that file (made
# first when missing, while the tests run). NCU=1: Nsight Compute on the first variant's expert GEMMs
# (bench/gpu_ncu.sh moe) at the end. FIRST_TESTS_ONLY=1: the tests in the first build only; KTESTS="not zzz": every
# kernel test, not only the GEMM ones; GEMM_ROWS=512,4096: bench_gemm.py at those rows per variant too;
# CHUNK_TOKENS: the prompt each chunk figure feeds (default 8192: one chunk timed after the warm-up). Logs
# (moe_<n>.log, gemm_<n>.log, prefill_<n>.log, backend.log, ncu_moe.txt) come back as $OUT/moe_logs.tgz.
#   VARIANTS=";MOE_NARROW_LAST=0;MOE_WIDE_PAIRS=100000" MODEL=models/flash-realistic.gguf bash bench/gpu_moe.sh
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
[ -n "${MODEL:-}" ] && make_flash "$MODEL"
IFS=';' read -ra variants <<< "${VARIANTS:-}"
[ ${#variants[@]} -eq 0 ] && variants=("")
for i in "${!variants[@]}"; do
    export STRATA_KERNEL_DEFINES="${variants[$i]}"
    echo "== defines: '${variants[$i]}' (at ${SECONDS} s)"
    : > "$out/moe_${i}.log"
    if [ "$i" = 0 ] || [ -z "${FIRST_TESTS_ONLY:-}" ]; then
        timeout "${TESTS_S:-150}" python3 -m pytest -q -rs -m gpu tests/test_cuda_kernels.py \
            -k "${KTESTS:-grouped or gemm or prepared}" > "$out/moe_${i}.log" 2>&1
        grep -E "FAILED|passed|failed" "$out/moe_${i}.log" | tail -6
    fi
    if [ "$i" = 0 ]; then
        timeout "${BACKEND_S:-150}" python3 -m pytest -q -rs -m gpu tests/test_cuda_backend.py > "$out/backend.log" 2>&1
        grep -E "FAILED|passed|failed" "$out/backend.log" | tail -6
    fi
    timeout "${PHASE_S:-120}" python3 bench/gpu_check.py --phases moe >> "$out/moe_${i}.log" 2>&1
    grep -E "\] moe |Error" "$out/moe_${i}.log"
    if [ -n "${GEMM_ROWS:-}" ]; then
        timeout "${GEMM_S:-90}" python3 bench/bench_gemm.py --rows "$GEMM_ROWS" --reps 5 > "$out/gemm_${i}.log" 2>&1
        grep -E "^(gdn|qsa|expert|shexp|hc)|Error" "$out/gemm_${i}.log"
    fi
done
if [ -n "${MODEL:-}" ]; then
    wait
    for i in "${!variants[@]}"; do
        export STRATA_KERNEL_DEFINES="${variants[$i]}"
        echo "== chunk, defines: '${variants[$i]}' (at ${SECONDS} s)"
        timeout "${PREFILL_S:-150}" python3 bench/bench_prefill_gpu.py --model "$MODEL" --chunks 4096 \
            --tokens "${CHUNK_TOKENS:-8192}" > "$out/prefill_${i}.log" 2>&1
        grep -E "^chunk|experts|Error" "$out/prefill_${i}.log"
    done
fi
if [ -n "${NCU:-}" ]; then
    export STRATA_KERNEL_DEFINES="${variants[0]}"
    timeout "${NCU_S:-200}" bash bench/gpu_ncu.sh moe | tail -80
fi
echo "total ${SECONDS} s"
# one archive (the device tool brings back a few files): whatever logs there are, the missing kinds skipped
(cd "$out" && shopt -s nullglob && logs=(./*.log ./*.txt) && tar czf moe_logs.tgz "${logs[@]}" && rm -f "${logs[@]}")
