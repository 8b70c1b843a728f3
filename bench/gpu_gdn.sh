#!/usr/bin/env bash
# The batched GDN core on the GPU machine, one call: for each set of compile-time defines in VARIANTS (';'-separated,
# the first the default build), the GDN kernel tests in that build, then bench/gpu_check.py's gdn phase (gdn_conv,
# gdn_prep, gdn_scan and gdn_out over a 4096-row chunk at the flash heads). Logs: $OUT/gdn_<n>.log.
#   VARIANTS=";NAME=VALUE" bash bench/gpu_gdn.sh   (the default build, then one with that -D define)
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
IFS=';' read -ra variants <<< "${VARIANTS:-}"
[ ${#variants[@]} -eq 0 ] && variants=("")
for i in "${!variants[@]}"; do
    export STRATA_KERNEL_DEFINES="${variants[$i]}"
    echo "== defines: '${variants[$i]}' (at ${SECONDS} s)"
    timeout "${TESTS_S:-90}" python3 -m pytest -q -rs -m gpu tests/test_cuda_kernels.py -k gdn > "$out/gdn_${i}.log" 2>&1
    grep -E "passed|failed" "$out/gdn_${i}.log" | tail -2
    timeout "${PHASE_S:-90}" python3 bench/gpu_check.py --phases gdn >> "$out/gdn_${i}.log" 2>&1
    grep -E "\] gdn |Error" "$out/gdn_${i}.log"
done
