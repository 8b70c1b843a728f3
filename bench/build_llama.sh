#!/usr/bin/env bash
# llama-bench with CUDA, built on the GPU machine from the llama.cpp source carried at .llama/llama-src.tar.xz
# (llama-cpp-python 0.3.36's vendor/llama.cpp, trimmed; bench/llama_src.sh makes it where pip reaches PyPI):
# Hopper only, static libraries, the host CPU's own instructions (the --n-cpu-moe runs compute experts on it).
# Writes .llama/llama-bench.xz, and with $OUT set a copy there in parts of at most 15 MiB (the device tool brings
# back files of up to 16 MiB): join them with cat.
#   bash bench/build_llama.sh          (JOBS=N compile jobs, default one per core)
# Built elsewhere (a machine with nvcc 13.0 but without the GPU machine's CPU), name the GPU host's instructions:
#   CPU=spr bash bench/build_llama.sh  (Sapphire Rapids: AVX-512 with VNNI and BF16, AMX; not this CPU's native set)
# A toolkit without cuBLAS or a GPU driver needs both where CMake looks: the nvidia-cublas 13.0 wheel's headers and
# libraries linked into its include/ and lib64/, and a libcuda stub in lib64/stubs (every cu* function of cuda.h as
# an empty function, soname libcuda.so.1; the GPU machine's driver replaces it at run time). ~25 min on 2 cores.
set -o pipefail
cd "$(dirname "$0")/.."
src=/tmp/llama-src build=/tmp/llama-build
if [ ! -d $src/llama.cpp ]; then
    mkdir -p $src && tar xJf .llama/llama-src.tar.xz -C $src || exit 1
fi
cpu=
if [ "${CPU:-}" = spr ]; then
    cpu="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON
         -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON
         -DGGML_AMX_BF16=ON"
fi
t0=$(date +%s)
cmake -S $src/llama.cpp -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF $cpu \
    > /tmp/llama-cmake.log 2>&1 || { tail -40 /tmp/llama-cmake.log; exit 1; }
cmake --build $build --target llama-bench -j "${JOBS:-$(nproc)}" > /tmp/llama-build.log 2>&1 \
    || { grep -m5 -B2 -A8 "error" /tmp/llama-build.log; tail -20 /tmp/llama-build.log; exit 1; }
bin=$build/bin/llama-bench
echo "llama-bench built in $(( $(date +%s) - t0 )) s: $(du -h $bin | cut -f1)"
xz -T0 -6 -c $bin > .llama/llama-bench.xz || exit 1
echo ".llama/llama-bench.xz: $(du -h .llama/llama-bench.xz | cut -f1)"
if [ -n "${OUT:-}" ]; then
    split -b 15M -d .llama/llama-bench.xz "$OUT/llama-bench.xz.part"
fi
