#!/usr/bin/env bash
# The GEMV phase's geometry sweep (gpu_check.py --phases gemv --sweep: every tile geometry of each flash matrix,
# timed as a graph of back-to-back launches) under each build variant, and per matrix the time model's pick against
# the fastest geometry. Variants are STRATA_KERNEL_DEFINES values separated by ';' ('' = the defaults).
#   VARIANTS=";GEMV_STAGES=2" bash bench/gpu_gemv_sweep.sh   -> $OUT/sweep_<n>.log, the table on stdout
set -o pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
IFS=';' read -r -a variants <<< "${VARIANTS:-}"
[ ${#variants[@]} -eq 0 ] && variants=("")
rc=0
for i in "${!variants[@]}"; do
    v=${variants[$i]}
    STRATA_KERNEL_DEFINES="$v" python3 bench/gpu_check.py --phases gemv --sweep > "$out/sweep_$i.log" 2>&1 || rc=1
    echo "== variant '${v}'"
    python3 - "$out/sweep_$i.log" <<'PY'
import re, sys
best, pick, final = {}, {}, {}
for line in open(sys.argv[1]):
    line = re.sub(r"^\[gpu_check [\d:]+\] ", "", line)
    m = re.match(r"\s*sweep (.+?) (?:nt\s+\d+ )?tpg\s+(\d+)(?: rr (\d))?: +([\d.]+) us( \(the (?:time model's|current) pick\))?", line)
    if m:
        lab, us = m.group(1), float(m.group(4))
        g = f"tpg {m.group(2)} rr {m.group(3) or '-'}"
        if lab not in best or us < best[lab][1]:
            best[lab] = (g, us)
        if m.group(5):
            pick[lab] = (g, us)
    m = re.match(r"gemv (.+?): ([\d.]+) us, (\d+) GB/s", line)
    if m:
        final[m.group(1)] = (float(m.group(2)), int(m.group(3)))
for lab, (us, gbps) in final.items():
    b = best.get(lab, ("-", float("nan")))
    p = pick.get(lab, ("-", float("nan")))
    print(f"  {lab:<26} {us:8.1f} us {gbps:5d} GB/s | pick {p[0]:<14} {p[1]:8.1f} | best {b[0]:<14} {b[1]:8.1f}")
PY
    grep -E "Error|error" "$out/sweep_$i.log" | head -3
done
exit $rc
