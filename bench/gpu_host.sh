#!/usr/bin/env bash
# Where a decode token's host work goes, and a streamed chunk's per-layer split, in one GPU-machine call: the flash
# file (realistic mix and routing) made while the GPU tests named by TESTS run, then bench_host.py every weight in
# VRAM and under the 24 GiB budget (every expert preloaded into host memory, so decode rows run mapped; with
# PROFILE=N one more request under cProfile, its N costliest functions), then bench_stream.py's per-layer copy
# time and the share hidden (4096-row chunks, streamed). Logs in $OUT as one logs.tgz.
#   bash bench/gpu_host.sh      CONFIGS="vram budget24", PROFILE=30 (0: none), STREAM_S=200 (0: no bench_stream),
#                               TESTS (pytest arguments, -m gpu; "" for none): by default the kernel and backend
#                               tests of the host paths (route, host_copy, streamed, mapped, copy_batch)
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
model=${MODEL:-models/flash-realistic.gguf}
make_flash "$model"
TESTS=${TESTS-"tests/test_cuda_kernels.py tests/test_cuda_backend.py -k 'route or host_copy or streamed or mapped or copy_batch'"}
if [ -n "$TESTS" ]; then
    eval "timeout ${TESTS_S:-200} python3 -m pytest -q -rs -m gpu $TESTS" > "$out/gpu_tests.log" 2>&1
    grep -E "FAILED|Error|passed|failed" "$out/gpu_tests.log" | tail -8
fi
wait
echo "model ready at ${SECONDS} s"
for name in ${CONFIGS:-vram budget24}; do
    gib=70; extra=()
    [ "$name" = budget24 ] && gib=24 && extra=(--preload)
    [ "${PROFILE:-30}" != 0 ] && extra+=(--profile "${PROFILE:-30}")
    timeout "${HOST_S:-150}" python3 bench/bench_host.py --model "$model" --backend cuda --vram-budget-gib "$gib" \
        --tokens 64 "${extra[@]}" > "$out/host_$name.log" 2>&1
    echo "== $name"
    sed -n '/^decode:/,/^host overhead/p' "$out/host_$name.log" | grep -v "  0.000    0.0%"
    grep -E "Error" "$out/host_$name.log" | head -3
done
echo "host done at ${SECONDS} s"
if [ "${STREAM_S:-200}" != 0 ]; then
    timeout "${STREAM_S:-200}" python3 bench/bench_stream.py --model "$model" --tokens 8192 --step-tokens 4096 \
        --modes always --all-layers > "$out/stream.log" 2>&1
    grep -vE "^ +([0-9]|1[0-9]|2[0-9]|3[0-9]|4[0-3]) " "$out/stream.log" | tail -20
fi
echo "total ${SECONDS} s"
(cd "$out" && tar czf logs.tgz ./*.log && rm -f ./*.log)
exit 0
