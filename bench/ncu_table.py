"""Sum an Nsight Compute CSV (`ncu --csv --page raw`, gpu__time_duration.sum and launch__grid_size) by kernel and
grid: count per token, median and total us per token, share of the sum, largest first.

    python bench/ncu_table.py ncu.csv --tokens 1 [--graph-ms 8.9]

Each node was timed alone (ncu serializes them, ramp and drain included), so the sum is the kernels' own time;
--graph-ms (the whole-token graph's native ms/token, from gpu_check.py's bench phase) prints the difference: the
time between nodes when positive, what programmatic dependent launch overlapped when negative.
"""

from __future__ import annotations

import argparse
import csv
import io
from collections import defaultdict
from statistics import median

UNIT_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6}


def rows(text: str) -> tuple[list[dict], dict]:
    start = next((i for i, line in enumerate(text.splitlines()) if line.startswith('"ID"')), None)
    if start is None:
        raise SystemExit("no ncu CSV table (a line starting with \"ID\") in the input")
    data = list(csv.DictReader(io.StringIO("\n".join(text.splitlines()[start:]))))
    units, body = data[0], data[1:]
    return body, units


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--tokens", type=int, default=1, help="tokens the profile holds (per-token figures)")
    ap.add_argument("--graph-ms", type=float, default=None, help="the whole-token graph's ms/token, for the gap")
    a = ap.parse_args()
    body, units = rows(open(a.csv, errors="replace").read())
    scale = UNIT_US.get(units.get("gpu__time_duration.sum", "nsecond").strip(), 1e-3)
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in body:
        name = r["Kernel Name"].split("(")[0].strip()
        groups[(name, r.get("launch__grid_size", "?"))].append(float(r["gpu__time_duration.sum"].replace(",", "")) * scale)
    total = sum(sum(v) for v in groups.values()) / a.tokens
    print(f"{sum(len(v) for v in groups.values()) / a.tokens:.0f} kernel nodes a token, {total / 1e3:.3f} ms of "
          f"kernel time a token" + (f"; the graph takes {a.graph_ms:.3f} ms: {a.graph_ms - total / 1e3:+.3f} ms "
                                    f"beside the kernels' sum" if a.graph_ms else ""))
    print(f"| kernel | grid | nodes/token | median us | us/token | share |\n|---|---:|---:|---:|---:|---:|")
    for (name, grid), v in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        per = sum(v) / a.tokens
        print(f"| {name} | {grid} | {len(v) / a.tokens:.0f} | {median(v):.1f} | {per:.1f} | {per / total:.1%} |")


if __name__ == "__main__":
    main()
