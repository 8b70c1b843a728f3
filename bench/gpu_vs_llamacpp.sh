#!/usr/bin/env bash
# Issue 6 on the GPU machine: strata next to llama.cpp's llama-bench on the same flash file, one configuration
# per call (vram | budget24), logged to $OUT/vs_llamacpp_<config>.log. llama-bench is not in the repository: build
# it from the llama-cpp-python 0.3.36 sdist (vendor/llama.cpp, -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90
# -DBUILD_SHARED_LIBS=OFF) and put it, xz-compressed, at .llama/llama-bench.xz (carried to the machine).
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
mkdir -p models
if [ ! -f models/flash.gguf ]; then
    python3 cli.py make-model --preset flash --ple-base 2000000 models/flash.gguf 2>&1 | tail -2 || exit 1
fi
python3 bench/bench_vs_llamacpp.py --model models/flash.gguf --config "$config" --llama-bench $bin "$@" 2>&1 \
    | tee "${OUT:-/tmp}/vs_llamacpp_$config.log"
