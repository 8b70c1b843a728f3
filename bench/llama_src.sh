#!/usr/bin/env bash
# The llama.cpp source that bench/build_llama.sh builds on the GPU machine: llama-cpp-python 0.3.36's
# vendor/llama.cpp (the version the references and the conversion tests use), downloaded here (the GPU machine has
# no network) and trimmed to what a CUDA llama-bench build reads: no vocab models, docs, media, tests, benches or
# the other backends' sources. Writes .llama/llama-src.tar.xz (ignored by git; carry it to the GPU machine with
# the build: carry [".llama/llama-src.tar.xz"], then `bash bench/build_llama.sh`, about 10 minutes there).
#   bash bench/llama_src.sh
set -o pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$tmp" || exit 1
tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp" || exit 1
src="$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp"
rm -rf "$src"/{models,docs,media,tests,benches,examples/*/,skills,gguf-py,conversion,scripts,ci,requirements} \
    "$src"/ggml/src/ggml-{vulkan,metal,sycl,opencl,cann,musa,hip,webgpu,kompute,zdnn,hexagon,zendnn,virtgpu,openvino}
mkdir -p .llama "$tmp/out" && mv "$src" "$tmp/out/llama.cpp"
tar cJf .llama/llama-src.tar.xz -C "$tmp/out" llama.cpp || exit 1
echo ".llama/llama-src.tar.xz: $(du -h .llama/llama-src.tar.xz | cut -f1)"
