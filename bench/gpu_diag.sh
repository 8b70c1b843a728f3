#!/usr/bin/env bash
# One GPU-machine call that checks the CUDA paths and shows where decode and streamed prefill spend their time:
# the CUDA tests and every GEMV tile geometry's time (while the realistic-routing flash file is made), then bench_host.py's decode trace at the 24 GiB
# budget and with every weight in VRAM, then bench_stream.py's per-layer copy/compute split. Logs and traces go
# to $OUT.   bash bench/gpu_diag.sh [decode tokens, default 64]
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
tokens=${1:-64}
model=models/flash-realistic.gguf
make_flash "$model"
python3 -m pytest -q -rs -m gpu tests/test_cuda_kernels.py tests/test_cuda_backend.py 2>&1 | tee "$out/gpu_tests.log" | tail -8
OUT= python3 bench/gpu_check.py --phases gemv --sweep > "$out/gemv_sweep.log" 2>&1
tail -14 "$out/gemv_sweep.log"
wait
tail -2 "$out/make_model.log" 2>/dev/null
for budget in 24 139; do
    python3 bench/bench_host.py --model $model --backend cuda --vram-budget-gib $budget --tokens "$tokens" \
        --warmup 48 --preload --trace "$out/trace$budget.jsonl" 2>&1 | tee "$out/host$budget.log"
done
python3 bench/bench_stream.py --model $model --tokens 4096 2>&1 | tee "$out/stream.log"
