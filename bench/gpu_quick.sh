#!/usr/bin/env bash
# The shortest useful GPU-machine call, for a session with little device time left: the flash file made
# (realistic mix and routing) while the CUDA backend tests, the batched kernels' tests and the PLE phase
# (gpu_check.py --phases ple) run, then one 4096-row prefill chunk stage by stage and launch by launch
# (bench_prefill_gpu.py --launches 30) and the all-VRAM decode (gpu_check.py --phases bench). Each part has its
# own time limit so that one slow part leaves the rest their time; logs in $OUT as one logs.tgz (the device tool
# brings back few files).
#   bash bench/gpu_quick.sh
#   KTESTS="..." (the kernel tests' -k, default the batched kernels'), QSA_VARIANTS=";QSA_HW=6" (the QSA attention
#   phase per build), DECODE_S=0 (no decode)
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
model=${MODEL:-models/flash-realistic.gguf}
make_flash "$model"
timeout 150 python3 -m pytest -q -rs -m gpu tests/test_cuda_backend.py > "$out/gpu_tests.log" 2>&1
grep -E "FAILED|passed|failed" "$out/gpu_tests.log" | tail -8
timeout "${KTESTS_S:-120}" python3 -m pytest -q -rs -m gpu tests/test_cuda_kernels.py \
    -k "${KTESTS:-gemm or grouped or prepared or qsa or gdn or combine or ple}" > "$out/kernel_tests.log" 2>&1
grep -E "FAILED|passed|failed" "$out/kernel_tests.log" | tail -8
# the PLE block's launches at a chunk and at one row (no model)
timeout "${PLE_S:-60}" python3 bench/gpu_check.py --phases ple > "$out/ple.log" 2>&1
grep -E "\] ple |Error" "$out/ple.log"
# QSA_VARIANTS=";QSA_HW=6": qsa_attn + qsa_combine at the flash heads per build (gpu_check.py's qsa phase, no model)
IFS=';' read -ra qv <<< "${QSA_VARIANTS:-}"
for i in "${!qv[@]}"; do
    STRATA_KERNEL_DEFINES="${qv[$i]}" timeout "${QSA_S:-80}" python3 bench/gpu_check.py --phases qsa \
        > "$out/qsa_$i.log" 2>&1
    echo "qsa defines '${qv[$i]}':"; grep -E "\] qsa |Error" "$out/qsa_$i.log"
done
wait
echo "model ready at ${SECONDS} s"
timeout "${PREFILL_S:-200}" python3 bench/bench_prefill_gpu.py --model "$model" --chunks 4096 --tokens 8192 \
    --launches 30 > "$out/prefill.log" 2>&1
grep -E "^chunk|^    |Error" "$out/prefill.log"
echo "prefill done at ${SECONDS} s"
if [ "${DECODE_S:-120}" != 0 ]; then
    timeout "${DECODE_S:-120}" python3 bench/gpu_check.py --phases bench --long-ctx 1024 --model "$model" \
        --routing realistic > "$out/decode.log" 2>&1
    grep -E "^(decode|per-layer|  sum)|Error" "$out/decode.log"
fi
echo "total ${SECONDS} s"
(cd "$out" && tar czf logs.tgz ./*.log && rm -f ./*.log)
exit 0
