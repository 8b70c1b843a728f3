#!/usr/bin/env bash
# Issue 13's all-VRAM decode in one GPU-machine call: models/flash.gguf made in the background (gpu_check.py's
# model phase) while the CUDA tests run (their failures listed, the timings taken anyway) and the GEMV kernels are
# timed alone, with every tile geometry when SWEEP=1 (the up_mix sweep included); then the whole-token bench (decode
# ms/token, per-stage breakdown) and, unless PROFILE=0, every kernel node timed by ncu (bench/gpu_profile.sh). Each
# variant in VARIANTS (";"-separated STRATA_KERNEL_DEFINES values, an empty one for the source's defaults: e.g.
# VARIANTS=";GEMV_EARLY_STAGE=0"; default just the source's) gets its own bench run, in the same call; BASE=<folder>
# (another tree of the repository, e.g. `git archive <commit>` unpacked under build/ and carried) gets one too, on
# the same model file, for a same-call comparison (and its GEMV timings, unless GEMV=0). MODEL=<path> (default
# models/flash.gguf) and ROUTING=realistic (default uniform: make-model's routing, when the file is made) name the
# flash file; GEMV=0 skips the GEMV timings, TESTS=0 the CUDA tests (run by an earlier call); ABLATE=1 adds, for
# the first variant, the whole-token graph without each kind of launch (gpu_check.py's ablate phase). Logs go to $OUT.
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
model=${MODEL:-models/flash.gguf}
mopt=(--model "$model" --routing "${ROUTING:-uniform}")
python3 bench/gpu_check.py --phases model "${mopt[@]}" > "$out/model.log" 2>&1 &
model_pid=$!
if [ "${TESTS:-1}" != 0 ]; then
    python3 -m pytest -q -rs -m gpu tests/test_cuda_kernels.py 2>&1 | tee "$out/kernel_tests.log" \
        | grep -E "FAILED|Error|passed|failed" | tail -25
    python3 -m pytest -q -rs -m gpu tests/test_cuda_backend.py 2>&1 | tee "$out/gpu_tests.log" | tail -3
fi
[ "${GEMV:-1}" != 0 ] && python3 bench/gpu_check.py --phases gemv ${SWEEP:+--sweep} 2>&1 | tee "$out/gemv.log" \
    | grep -E "gemv |sweep" | tail -60
wait $model_pid || { tail -5 "$out/model.log"; exit 1; }
IFS=';' read -ra variants <<< "${VARIANTS:-}"
[ ${#variants[@]} -eq 0 ] && variants=("")
for v in "${variants[@]}"; do
    echo "== STRATA_KERNEL_DEFINES='$v'"
    STRATA_KERNEL_DEFINES="$v" python3 bench/gpu_check.py --phases bench --long-ctx 1024 "${mopt[@]}" 2>&1 \
        | tee -a "$out/bench.log" | grep -E "^(decode|per-layer|  [a-z]|  sum)"
    [ "${ABLATE:-0}" != 0 ] && [ "$v" = "${variants[0]}" ] && STRATA_KERNEL_DEFINES="$v" python3 bench/gpu_check.py --phases ablate "${mopt[@]}" \
        2>&1 | tee -a "$out/ablate.log" | grep -E "whole-token|without|chain|no branch"
done
if [ -n "${BASE:-}" ]; then
    echo "== the tree in $BASE"
    mkdir -p "$BASE/models"
    ln -sfn "$(realpath "$model")" "$BASE/models/flash.gguf"      # the file its gpu_check.py opens
    (cd "$BASE" && python3 bench/gpu_check.py --phases bench --long-ctx 1024 2>&1) \
        | tee -a "$out/bench_base.log" | grep -E "^(decode|per-layer|  [a-z]|  sum)"
    [ "${GEMV:-1}" != 0 ] && (cd "$BASE" && python3 bench/gpu_check.py --phases gemv 2>&1) \
        | tee "$out/gemv_base.log" | grep -E "gemv " | tail -12
fi
[ "${PROFILE:-1}" != 0 ] && MODEL=$model bash bench/gpu_profile.sh 1 | head -30
exit 0
