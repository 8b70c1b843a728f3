"""CPU quantized matvec throughput: GB/s of weight bytes streamed, next to this machine's memory bandwidth.

    python bench/bench_quant.py [--threads N] [--quick] [--types Q2_0,Q4_K,Q8_0,IQ4_XS,Q6_K] [--matmul]

Memory bandwidth is measured in the same run as the read rate of numpy int64 sums over a 1 GiB array
(numpy releases the GIL in reductions), on 1 thread and on N threads splitting the array, before and
after the kernels; the percentages use the higher of the two (other load on a shared machine only ever
lowers a reading). Every kernel
timing streams a rotating set of distinct weights totalling >= 4x the L3 cache (>= 128 MiB), so the
cache cannot serve them; each figure is the median over repeats, after one warm-up pass.

1 thread: matvec_prepared on the calling thread. N threads: expert shapes are split over experts (each
thread streams its share of the set, the MoE layout); dense shapes are split over rows of each matrix.

Expert batch: whole SwiGLU experts (gate and up F x E, down E x F; F = 640, or 512 where 640 rows do not hold
whole 256-blocks), GB/s of their weight bytes, in calls of 10 experts (one layer's misses) and of 180 (a
token's worth), each pass over >= 4x L3 of distinct experts. "per-matvec": the CPU pool before
strata.quant.experts, a Python task per expert on a thread pool (matvec_prepared for gate and up, silu,
the down activation, down); "batch": strata.quant.experts.expert_batch, one compiled call per batch.

--matmul: T activation rows against one matrix that stays in cache (MATMUL_SHAPES, T in MATMUL_T), us per call and
GFLOP/s (2 T rows K / time): T matvec calls; strata.quant.matmul (one call, its own thread count); and
dequantize + BLAS: the matrix dequantized, each row's activation quantized and dequantized (activation_values),
one float32 BLAS matmul (numpy's BLAS threads), all inside the timing; "BLAS only" is that last product alone.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.quant import (QType, activation_values, block_size, dequantize, matvec, matvec_prepared,  # noqa: E402
                          prepare_activation, random_blocks, row_bytes, split_rows)
from strata.quant.experts import expert_batch, max_threads  # noqa: E402
from strata.quant.matmul import matmul  # noqa: E402
from strata.reference.common import silu  # noqa: E402

EXPERT_SHAPES = [(640, 2560), (2560, 640)]                      # (rows, K): gate/up, down of one expert
DENSE_SHAPES = [(10240, 2560), (2560, 6144), (248320, 2560)]    # dense projections, the output head
EXPERT_E = 2560                                                 # hidden size of the experts' input and output
EXPERT_BATCHES = (10, 180)                                      # one layer's routed misses; a token's (48 layers)
MATMUL_SHAPES = [(640, 256), (256, 256), (4096, 256)]           # (rows, K) of the --matmul table
MATMUL_T = (1, 8, 64, 512)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def l3_bytes() -> int:
    for idx in range(8):
        p = Path(f"/sys/devices/system/cpu/cpu0/cache/index{idx}")
        if (p / "level").exists() and (p / "level").read_text().strip() == "3":
            size = (p / "size").read_text().strip()
            return int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]]
    return 32 << 20


def median_time(fn, repeats: int) -> float:
    fn()                                                        # warm-up (and JIT compile on a cold cache)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def memory_bandwidth(pool: ThreadPoolExecutor, threads: int, repeats: int) -> tuple[float, float]:
    """Read GB/s of int64 sums over 1 GiB: (1 thread, `threads` threads)."""
    a = np.ones(1 << 27, np.int64)
    one = a.nbytes / median_time(lambda: a.sum(), repeats) / 1e9
    parts = np.array_split(a, threads)
    many = a.nbytes / median_time(lambda: list(pool.map(np.sum, parts)), repeats) / 1e9
    return one, many


def bench_case(qt, rows, k, pool, threads, target_bytes, repeats, rng, expert):
    wbytes = rows * row_bytes(qt, k)
    n_w = max(2, -(-target_bytes // wbytes))
    ws = [random_blocks(qt, (rows, k), rng, 0.02) for _ in range(n_w)]
    total = sum(w.nbytes for w in ws)
    act = prepare_activation(rng.standard_normal(k).astype(np.float32), qt)
    out = np.empty(rows, np.float32)

    def serial():
        for w in ws:
            matvec_prepared(w, qt, act, out)

    outs = [np.empty(rows, np.float32) for _ in range(threads)]

    def over_experts():
        def run(i):
            for w in ws[i::threads]:
                matvec_prepared(w, qt, act, outs[i])
        list(pool.map(run, range(threads)))

    spans = split_rows(rows, threads)

    def over_rows():
        for w in ws:
            for f in [pool.submit(matvec_prepared, w, qt, act, out, a, b) for a, b in spans]:
                f.result()

    t1 = median_time(serial, repeats)
    tn = median_time(over_experts if expert else over_rows, repeats)
    return wbytes, n_w, total / t1 / 1e9, total / tn / 1e9, t1 / n_w * 1e6


def expert_width(qt: QType) -> int:
    return 640 if 640 % block_size(qt) == 0 else 512


def bench_experts(qt, pool, threads, target_bytes, repeats, rng):
    """GB/s per batch size: (per-matvec 1 thread, per-matvec N threads, batch 1 thread, batch N threads)."""
    E, F = EXPERT_E, expert_width(qt)
    per = 2 * F * row_bytes(qt, E) + E * row_bytes(qt, F)
    n = max(max(EXPERT_BATCHES), -(-target_bytes // per))
    # distinct memory for every expert; the values need not differ (the kernels' work does not depend on them)
    seed = 8
    gate, up = (np.tile(random_blocks(qt, (seed * F, E), rng, E ** -0.5), (-(-n // seed), 1))[:n * F]
                for _ in range(2))                                            # (n * F, row_bytes)
    down = np.tile(random_blocks(qt, (seed * E, F), rng, F ** -0.5), (-(-n // seed), 1))[:n * E]
    x = rng.standard_normal(E).astype(np.float32)
    order = rng.permutation(n)
    one_pool = ThreadPoolExecutor(1)

    def per_matvec(ids, ex):
        act = prepare_activation(x, qt)

        def expert(e):
            g = matvec_prepared(gate[e * F:(e + 1) * F], qt, act)
            u = matvec_prepared(up[e * F:(e + 1) * F], qt, act)
            h = (silu(g) * u).astype(np.float32)
            return matvec_prepared(down[e * E:(e + 1) * E], qt, prepare_activation(h, qt))
        return list(ex.map(expert, ids))

    res = {}
    for k in EXPERT_BATCHES:
        calls = [order[i:i + k] for i in range(0, n - k + 1, k)]             # each expert at most once a pass
        nbytes = per * k * len(calls)
        runs = [lambda calls=calls: [per_matvec(c, one_pool) for c in calls],
                lambda calls=calls: [per_matvec(c, pool) for c in calls],
                lambda calls=calls: [expert_batch(gate, up, down, c, x, wt_gu=qt, wt_d=qt, n_threads=1) for c in calls],
                lambda calls=calls: [expert_batch(gate, up, down, c, x, wt_gu=qt, wt_d=qt, n_threads=threads)
                                     for c in calls]]
        res[k] = [nbytes / median_time(fn, repeats) / 1e9 for fn in runs]
    one_pool.shutdown()
    return E, F, per, res


def bench_matmul(types: list[QType], repeats: int) -> None:
    """The --matmul table (see the module doc)."""
    rng = np.random.default_rng(0)
    print(f"# {cpu_model()}, {os.cpu_count()} CPUs; matmul threads {max_threads()} (NUMBA_NUM_THREADS); "
          f"{time.strftime('%Y-%m-%d')}; python bench/bench_quant.py {' '.join(sys.argv[1:])}; medians of {repeats} "
          f"after a warm-up; load average at start {os.getloadavg()[0]:.2f}")
    print()
    print("| type | rows x K | T | T matvec us | GFLOP/s | matmul us | GFLOP/s | dequantize + BLAS us | GFLOP/s "
          "| BLAS only us | GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for qt in types:
        for rows, k in MATMUL_SHAPES:
            w = random_blocks(qt, (rows, k), rng, 0.05)
            for t in MATMUL_T:
                x = rng.standard_normal((t, k)).astype(np.float32)
                dense = dequantize(w, qt)
                a = np.stack([activation_values(prepare_activation(r, qt)) for r in x]).astype(np.float32)

                def deq_blas():
                    xa = np.stack([activation_values(prepare_activation(r, qt)) for r in x]).astype(np.float32)
                    return xa @ dequantize(w, qt).T

                runs = (lambda: [matvec(w, qt, r) for r in x], lambda: matmul(w, qt, x), deq_blas,
                        lambda: a @ dense.T)
                us = [median_time(fn, repeats) * 1e6 for fn in runs]
                flop = 2 * t * rows * k
                print(f"| {qt.name} | {rows}x{k} | {t} | " + " | ".join(f"{u:.0f} | {flop / u / 1e3:.1f}" for u in us)
                      + " |", flush=True)
    print()
    print(f"# numba threading layer {numba.threading_layer()}; load average at end {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quick", action="store_true", help="3 repeats instead of 7 (--matmul: 5)")
    ap.add_argument("--types", default="Q2_0,Q4_K,Q8_0,IQ4_XS,Q6_K")
    ap.add_argument("--matmul", action="store_true", help="only the batched-rows table (threads: NUMBA_NUM_THREADS)")
    args = ap.parse_args()
    repeats = 3 if args.quick else 7
    types = [QType[t] for t in args.types.split(",")]
    if args.matmul:
        bench_matmul(types, 3 if args.quick else 5)
        return
    pool = ThreadPoolExecutor(args.threads)
    rng = np.random.default_rng(0)
    target = max(128 << 20, 4 * l3_bytes())

    print(f"# {cpu_model()}, {os.cpu_count()} CPUs, L3 {l3_bytes() >> 20} MiB; threads={args.threads}; "
          f"{time.strftime('%Y-%m-%d')}; python bench/bench_quant.py {' '.join(sys.argv[1:])}")
    print(f"# weights rotate through >= {target >> 20} MiB of distinct matrices per timing; medians of {repeats}; "
          f"load average at start {os.getloadavg()[0]:.2f}")
    bw1, bwn = memory_bandwidth(pool, args.threads, repeats)
    print(f"# memory read bandwidth before (numpy int64 sum, 1 GiB): 1 thread {bw1:.1f} GB/s, "
          f"{args.threads} threads {bwn:.1f} GB/s")
    rows_out = []
    for qt in types:
        for rows, k in EXPERT_SHAPES + DENSE_SHAPES:
            expert = (rows, k) in EXPERT_SHAPES
            if k % block_size(qt):
                rows_out.append((qt, rows, k, None))
                continue
            rows_out.append((qt, rows, k, bench_case(qt, rows, k, pool, args.threads, target, repeats, rng, expert)))
            print(f"# {qt.name} {rows}x{k} done", file=sys.stderr, flush=True)
    experts_out = []
    for qt in types:
        experts_out.append((qt, bench_experts(qt, pool, args.threads, target, repeats, rng)))
        print(f"# {qt.name} expert batch done", file=sys.stderr, flush=True)
    end1, endn = memory_bandwidth(pool, args.threads, repeats)
    print(f"# memory read bandwidth after: 1 thread {end1:.1f} GB/s, {args.threads} threads {endn:.1f} GB/s; "
          f"load average at end {os.getloadavg()[0]:.2f}")
    bw1, bwn = max(bw1, end1), max(bwn, endn)
    print()
    print(f"| type | rows x K | MB/matrix | 1 thr GB/s | % of {bw1:.1f} | us/call 1 thr | {args.threads} thr GB/s "
          f"| % of {bwn:.1f} | {args.threads} thr split |")
    print("|---|---|---|---|---|---|---|---|---|")
    for qt, rows, k, res in rows_out:
        if res is None:
            print(f"| {qt.name} | {rows}x{k} | - | n/a: K % {block_size(qt)} != 0 | | | | | |")
            continue
        wb, _, g1, gn, us = res
        print(f"| {qt.name} | {rows}x{k} | {wb / 1e6:.2f} | {g1:.1f} | {100 * g1 / bw1:.0f}% | {us:.0f} | "
              f"{gn:.1f} | {100 * gn / bwn:.0f}% | {'experts' if (rows, k) in EXPERT_SHAPES else 'rows'} |")

    print()
    print(f"Expert batch (numba threading layer {numba.threading_layer()}, OMP_WAIT_POLICY "
          f"{os.environ.get('OMP_WAIT_POLICY', '-')}, GOMP_SPINCOUNT {os.environ.get('GOMP_SPINCOUNT', '-')}): "
          f"GB/s of expert weight bytes")
    print()
    print(f"| type | E x F | MB/expert | experts/call | per-matvec 1 thr | per-matvec {args.threads} thr "
          f"| batch 1 thr | % of {bw1:.1f} | batch {args.threads} thr | % of {bwn:.1f} |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for qt, (E, F, per, res) in experts_out:
        for k, (o1, on, b1, bn) in res.items():
            print(f"| {qt.name} | {E}x{F} | {per / 1e6:.2f} | {k} | {o1:.1f} | {on:.1f} | {b1:.1f} | "
                  f"{100 * b1 / bw1:.0f}% | {bn:.1f} | {100 * bn / bwn:.0f}% |")


if __name__ == "__main__":
    main()
