"""Summarize Nsight Compute's SASS source page (`ncu -i R --page source --csv --print-source sass`): the warp-state
samples by opcode and the hottest instructions, so a kernel's stalls can be read against its code.

    python bench/ncu_source.py src.csv [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import re


def _num(s: str) -> float:
    s = s.replace(",", "").strip()
    try:
        return float(s)
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    text = open(a.csv, encoding="utf-8", errors="replace").read()
    start = text.find('"Address"')     # ncu prints the kernel's name (and maybe more) before the table
    if start < 0:
        start = text.find('"#')
    rows = list(csv.reader(io.StringIO(text[max(start, 0):])))
    if not rows:
        print("no table in", a.csv)
        return
    head = rows[0]
    print("columns:", " | ".join(head))
    src = next((i for i, h in enumerate(head) if h.strip().lower() == "source"), 1)
    samp = [i for i, h in enumerate(head) if "Sampling" in h or "stall" in h.lower()]
    execd = next((i for i, h in enumerate(head) if h.startswith("Instructions Executed")), None)
    if not samp:
        print("no sampling columns")
        return
    allc = next((i for i in samp if "All" in head[i]), samp[0])
    body = [r for r in rows[1:] if len(r) == len(head)]
    total = sum(_num(r[allc]) for r in body) or 1.0
    ops = collections.Counter()
    ops_n = collections.Counter()
    for r in body:
        op = re.sub(r"^@!?U?P\w+\s+", "", r[src].strip()).split(" ")[0].split(".")[0]
        ops[op] += _num(r[allc])
        if execd is not None:
            ops_n[op] += _num(r[execd])
    print(f"{len(body)} instructions, {total:.0f} samples ({head[allc]})")
    print("by opcode (share of samples, instructions executed):")
    for op, s in ops.most_common(20):
        print(f"  {op:<10} {100 * s / total:5.1f}%  {ops_n[op]:12.0f}")
    reasons = [i for i, h in enumerate(head) if h.startswith("stall_") and "Not Issued" not in h]
    if reasons:
        tot = {head[i][6:]: sum(_num(r[i]) for r in body) for i in reasons}
        print("by stall reason (samples): " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                        sorted(tot.items(), key=lambda kv: -kv[1]) if v))
    print(f"hottest {a.top} instructions:")
    hot = sorted(body, key=lambda r: -_num(r[allc]))[: a.top]
    extra = [i for i in range(len(head)) if i not in (src,) and i != 0 and _num_col(body, i)][:8]
    print("  " + " | ".join(head[i] for i in extra))
    for r in hot:
        why = sorted(((head[i][6:], _num(r[i])) for i in reasons), key=lambda kv: -kv[1])[:2]
        print(f"  {r[0][-6:]:>6} {r[src][:52]:<52} " + " ".join(r[i] for i in extra[:4]) + "  "
              + " ".join(f"{k}:{v:.0f}" for k, v in why if v))


def _num_col(body, i) -> bool:
    return any(re.fullmatch(r"[\d,.]+", r[i].strip() or "x") for r in body[:50])


if __name__ == "__main__":
    main()
