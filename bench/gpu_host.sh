#!/usr/bin/env bash
# Where a decode token's host work goes, and a streamed chunk's per-layer split, in one GPU-machine call: the flash
# file (realistic mix and routing), then bench_host.py with --profile (the measured request under cProfile, then
# again without it for the trace's figures) every weight in VRAM and under the 24 GiB budget (every expert preloaded
# into host memory, so decode rows run mapped), then bench_stream.py's per-layer copy time and the share hidden
# (4096-row chunks, streamed). Logs in $OUT as one logs.tgz.
#   bash bench/gpu_host.sh            PROFILE=40 (functions listed), STREAM_S=200 (0: no bench_stream)
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
out=${OUT:-/tmp}
model=${MODEL:-models/flash-realistic.gguf}
make_flash "$model"
wait
echo "model ready at ${SECONDS} s"
for cfg in "vram 70" "budget24 24"; do
    read -r name gib <<< "$cfg"
    extra=(); [ "$name" = budget24 ] && extra=(--preload)
    timeout "${HOST_S:-150}" python3 bench/bench_host.py --model "$model" --backend cuda --vram-budget-gib "$gib" \
        --tokens 64 --profile "${PROFILE:-40}" "${extra[@]}" > "$out/host_$name.log" 2>&1
    echo "== $name"; grep -E "^(decode|host overhead|VRAM)|sample|launch|other/host|total|Error" "$out/host_$name.log" | head -20
done
echo "host done at ${SECONDS} s"
if [ "${STREAM_S:-200}" != 0 ]; then
    timeout "${STREAM_S:-200}" python3 bench/bench_stream.py --model "$model" --tokens 8192 --step-tokens 4096 \
        --modes always --all-layers > "$out/stream.log" 2>&1
    tail -60 "$out/stream.log"
fi
echo "total ${SECONDS} s"
(cd "$out" && tar czf logs.tgz ./*.log && rm -f ./*.log)
exit 0
