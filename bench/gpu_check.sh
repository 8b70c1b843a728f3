#!/usr/bin/env bash
# The GPU machine's entry point: its environment (bench/gpu_env.sh: the carried wheels, the kernel cache), then
# bench/gpu_check.py with the arguments given, logged to $OUT/gpu_check.log.
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
python3 bench/gpu_check.py "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
