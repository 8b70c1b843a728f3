#!/usr/bin/env bash
# QSA attention on the GPU machine, one call: the QSA kernel tests, then bench/gpu_check.py's qsa phase for this
# tree's kernels under each set of compile-time defines in VARIANTS (';'-separated; the first is the default build),
# and, when BASE names a `git archive` tarball of another commit, for that commit's kernels (its qsa.cu and qsa.py
# under this tree's bench phase). Results: $OUT/qsa_<n>.json. With MODEL set (the flash file, made while the tests
# run when missing), the batched step's GPU tests too, then a 4096-row chunk's whole graph and stages every weight in
# VRAM (bench_prefill_gpu.py) in this tree and, when TREE names another tree of the repository (`git archive`
# unpacked under build/ and carried), in that one: $OUT/prefill_<tree>.log.
#   BASE=.cache/head.tgz VARIANTS=";QSA_HW=4" bash bench/gpu_qsa.sh
#   MODEL=models/flash-realistic.gguf TREE=build/base VARIANTS=";QSA_TC_STAGES=3" bash bench/gpu_qsa.sh
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
[ -n "${MODEL:-}" ] && make_flash "$MODEL"
python3 -m pytest -q -rs -m gpu tests/test_cuda_kernels.py -k "qsa" 2>&1 | tail -4
if [ -n "${MODEL:-}" ]; then
    timeout "${TEST_S:-240}" python3 -m pytest -q -rs -m gpu tests/test_cuda_backend.py -k "${BTESTS:-batched or chunk}" \
        > "$out/gpu_tests.log" 2>&1
    grep -E "FAILED|passed|failed" "$out/gpu_tests.log" | tail -8
fi
n=0
IFS=';' read -ra variants <<< "${VARIANTS:-}"
[ ${#variants[@]} -eq 0 ] && variants=("")
for v in "${variants[@]}"; do
    echo "== defines: '${v}'"
    STRATA_KERNEL_DEFINES="$v" OUT=/tmp/qsa_run python3 bench/gpu_check.py --phases qsa 2>&1 | grep "qsa \|Error\|error" \
        && cp /tmp/qsa_run/gpu_check.json "$out/qsa_$n.json"
    n=$((n + 1))
done
if [ -n "${BASE:-}" ]; then
    echo "== base: $BASE"
    rm -rf /tmp/base && mkdir -p /tmp/base && tar -xzf "$BASE" -C /tmp/base || exit 1
    cp -r strata/model/synth.py /tmp/base/strata/model/ && cp bench/gpu_check.py /tmp/base/bench/
    (cd /tmp/base && STRATA_CACHE=/tmp/base/.cache OUT=/tmp/qsa_base python3 bench/gpu_check.py --phases qsa 2>&1 \
        | grep "qsa \|Error\|error") && cp /tmp/qsa_base/gpu_check.json "$out/qsa_base.json"
fi
if [ -n "${MODEL:-}" ]; then
    wait                              # the model file, when it is being made
    [ -f "$MODEL" ] || { tail -5 "$out/make_model.log"; exit 1; }
    model=$(realpath "$MODEL")
    for tree in . ${TREE:-}; do
        echo "== prefill: $tree"
        log="$out/prefill_$(basename "$(realpath "$tree")").log"
        (cd "$tree" && STRATA_CACHE="$PWD/.cache" python3 bench/bench_prefill_gpu.py --model "$model" --chunks 4096 \
            --tokens 8192 --launches 12) > "$log" 2>&1
        grep -E "graph|qsa_attn|tok/s|Error" "$log" | head -12
    done
fi
