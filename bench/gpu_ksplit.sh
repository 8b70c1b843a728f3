#!/usr/bin/env bash
# Split-K GEMM launches (strata/kernels/gemm.py k_slices) in one GPU-machine call: the flash file made
# (MODEL, default models/flash-realistic.gguf, realistic mix and routing) while the GEMM kernel tests and the batched
# step's backend tests run, then prefill chunks of CHUNKS rows (default 512,1024,4096) with every weight in VRAM
# (bench_prefill_gpu.py: the whole-step graph and the stages) in each build of VARIANTS (';'-separated kernel
# defines, default the default build and GEMM_KSPLIT=0), in turn, and with LLAMA=1 llama.cpp on the same file in
# the same run (bench/gpu_vs_llamacpp.sh vram, carry .llama/llama-bench.xz). Logs in $OUT (prefill_<n>.log).
#   bash bench/gpu_ksplit.sh
#   CHUNKS=512 LLAMA=1 bash bench/gpu_ksplit.sh
#   CHUNKS=1024,2048 VARIANTS=";GEMM_NARROW_APART=0" bash bench/gpu_ksplit.sh
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
model=${MODEL:-models/flash-realistic.gguf}
make_flash "$model"
timeout "${TEST_S:-200}" python3 -m pytest -q -rs -m gpu tests/test_cuda_kernels.py tests/test_cuda_backend.py \
    -k "${TESTS:-gemm or split_k or batched_equals}" > "$out/gpu_tests.log" 2>&1
grep -E "FAILED|passed|failed" "$out/gpu_tests.log" | tail -8
wait
[ -f "$model" ] || { tail -5 "$out/make_model.log"; exit 1; }
echo "model ready at ${SECONDS} s"
IFS=';' read -ra variants <<< "${VARIANTS-;GEMM_KSPLIT=0}"
[ ${#variants[@]} -eq 0 ] && variants=("")
for n in "${!variants[@]}"; do
    v=${variants[$n]}
    echo "== defines '$v'"
    STRATA_KERNEL_DEFINES="$v" timeout "${PREFILL_S:-240}" python3 bench/bench_prefill_gpu.py --model "$model" \
        --chunks "${CHUNKS:-512,1024,4096}" --tokens 8192 > "$out/prefill_$n.log" 2>&1
    grep -E "^chunk|Error" "$out/prefill_$n.log"
done
if [ "${LLAMA:-0}" = 1 ]; then
    MODEL=$model timeout "${LLAMA_S:-200}" bash bench/gpu_vs_llamacpp.sh vram --prefill 512,4096 --repeats 1 \
        2>&1 | grep -E "^\| (prefill|decode)"
fi
echo "total ${SECONDS} s"
