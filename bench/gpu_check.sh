#!/usr/bin/env bash
# The GPU machine's entry point: install carried wheels (gguf, transformers 5.23, ... in .whl/), keep the kernel
# cache in the repository (it survives between calls on a warm machine), then bench/gpu_check.py with the
# arguments given, logged to $OUT/gpu_check.log.
set -o pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 STRATA_CACHE="$PWD/.cache"
python3 bench/gpu_check.py "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
