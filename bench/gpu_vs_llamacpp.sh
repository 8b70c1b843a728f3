#!/usr/bin/env bash
# Issue 6 on the GPU machine: strata next to llama.cpp's llama-bench on the same flash file, one configuration
# per call (vram | budget24), logged to $OUT/vs_llamacpp_<config>.log. llama-bench is not in the repository:
# bench/build_llama.sh builds it on the GPU machine and writes it, xz-compressed, to .llama/llama-bench.xz (carry
# that file to the machine). MODEL=path: another flash file (default models/flash.gguf, made here if missing, with
# make-model's routing ROUTING: uniform by default, realistic for the calibrated skew).
#   bash bench/gpu_vs_llamacpp.sh vram [extra bench_vs_llamacpp.py arguments]
set -o pipefail
cd "$(dirname "$0")/.."
config=${1:?vram or budget24}; shift
source bench/gpu_env.sh || exit 1
bin=/tmp/llama-bench
if [ ! -x $bin ]; then
    xz -dc .llama/llama-bench.xz > $bin && chmod +x $bin || exit 1
fi
# the CUDA runtime and cuBLAS llama-bench links against: the toolkit's, else the pip wheels'
libs=$(python3 - <<'PY'
import glob, os, site
dirs = ["/usr/local/cuda/lib64"] + [os.path.dirname(p) for sp in site.getsitepackages()
        for p in glob.glob(os.path.join(sp, "nvidia", "*", "lib", "libcu*.so*"))]
print(":".join(dict.fromkeys(dirs)))
PY
)
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if ! $bin --help > /dev/null 2>&1; then
    ldd $bin | grep "not found"; echo "llama-bench does not start"; exit 1
fi
model=${MODEL:-models/flash.gguf}
mkdir -p models
if [ ! -f "$model" ]; then
    python3 cli.py make-model --preset flash --ple-base 2000000 --routing "${ROUTING:-uniform}" "$model" 2>&1 \
        | tail -2 || exit 1
fi
python3 bench/bench_vs_llamacpp.py --model "$model" --config "$config" --llama-bench $bin "$@" 2>&1 \
    | tee "${OUT:-/tmp}/vs_llamacpp_$config.log"
# Under a budget a mapped token's misses cross PCIe as kernel reads of pinned host memory, whose rate varies by host
# (33.5 and 48 GB/s on two H100 machines, bench/RESULTS.md "fifteenth session"): the same file's readers, timed
if [ "$config" = budget24 ]; then
    python3 bench/gpu_check.py --phases overlap --model "$model" --routing "${ROUTING:-uniform}" 2>&1 \
        | grep -E "reader (264|16) CTAs: alone" | tee -a "${OUT:-/tmp}/vs_llamacpp_$config.log"
fi
