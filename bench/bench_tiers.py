"""Tiered-memory benchmark (issue 16): decode with the experts behind a VRAM cache, a RAM tier of --host-budgets
and the SSD, and the PLE rows from their RAM cache or the SSD; and what the disk itself does at queue depth 1 and 32.

    python bench/bench_tiers.py --model models/small.gguf --host-budgets 0,0.004,0.012,all --tokens 32
    python bench/bench_tiers.py --model flash.gguf --backend cuda --vram-budget-gib 24 --host-budgets 4,12,20

A cold measurement needs the page cache out of the way. Every expert and PLE read here is O_DIRECT (the engine's
default; --buffered reads through the page cache instead, for comparison), and before each configuration the model
file's cached pages are dropped with posix_fadvise(DONTNEED), so the dense weights the engine maps start cold too.
Where the filesystem refuses O_DIRECT (the engine's open line then says "buffered pread") the DONTNEED is the only
guard: run `sync; echo 3 > /proc/sys/vm/drop_caches` (root) before each run for a cold figure.

Each configuration runs in its own process (its peak RSS is its own): open, a warm-up request (numba compilation,
the first reads; the RAM tier and the caches fill), then the measured request, a different prompt. Printed per
configuration: decode ms/token and tok/s, where the distinct experts of the decode steps came from (VRAM / RAM /
SSD), PLE rows from the RAM cache, SSD bytes per token (experts, PLE), the read rate while reads were in flight
against the disk's measured limits, the share of the SSD time hidden behind device and CPU-pool work, and peak RSS.
Before that: O_DIRECT random reads of 4 KiB (a PLE row's block) and of one expert blob's span on the model file at
queue depth 1 and 32 (one reader thread per request in flight: os.preadv takes one offset, so the depth comes from
threads), and a step's worth of PLE rows read the engine's way (O_DIRECT, 32 threads) against the buffered way
(POSIX_FADV_WILLNEED on every row, then preads, the file's pages dropped first).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.host.direct_io import ALIGN, align_up, aligned_empty, open_file, peak_rss_bytes  # noqa: E402  (checkout)

GIB, MIB = 1 << 30, 1 << 20
REPEATS = 3               # raw disk figures: the median of this many runs (a shared VM's disk moves a lot)
PROMPTS = ("The lighthouse stood at the end of a long stone pier", "Once upon a time, in a village by the sea")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="GGUF file")
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--vram-budget-gib", type=float, default=24.0, help="CUDA: the device memory budget")
    p.add_argument("--host-budgets", default="0,all",
                   help="RAM-tier budgets to run, comma-separated: GiB, 'all' (every expert, preloaded before the "
                        "warm-up) or 'mapped' (CPU: the backend computes the experts from the mapped file; CUDA: "
                        "every expert in VRAM)")
    p.add_argument("--ple-cache-mib", type=float, default=64.0, help="the PLE hot-row cache")
    p.add_argument("--tokens", type=int, default=32, help="decode tokens measured")
    p.add_argument("--warmup", type=int, default=8, help="tokens of the warm-up request")
    p.add_argument("--prefill", type=int, default=512,
                   help="then a prompt of this many random tokens, timed to its first token (0: none)")
    p.add_argument("--step-tokens", type=int, default=512, help="prompt rows per step (HostConfig.step_tokens)")
    p.add_argument("--cpu-threads", type=int, default=None, help="CPU expert pool threads (default: one per core)")
    p.add_argument("--io-threads", type=int, default=32, help="reads in flight at once (default 32)")
    p.add_argument("--prefetch", default="off", choices=["off", "previous", "router"],
                   help="HostConfig.prefetch: start reading each layer's likely experts while the layer before runs")
    p.add_argument("--buffered", action="store_true", help="buffered preads (the page cache) instead of O_DIRECT")
    p.add_argument("--raw-reads", type=int, default=2000, help="reads per raw disk measurement (0: skip them)")
    p.add_argument("--json", help="also write the results here (one JSON object)")
    p.add_argument("--child", help=argparse.SUPPRESS)          # one configuration, in its own process
    a = p.parse_args(argv)
    if a.tokens < 2:
        p.error("--tokens must be at least 2 (decode speed is measured between tokens)")
    return a


# ---- the disk ---------------------------------------------------------------------------------------------------
def drop_file_cache(path: str) -> None:
    """The file's clean pages out of the page cache (no root needed; pages mapped by a live process stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_reads(path: str, size: int, n: int, qd: int, seed: int = 0) -> dict:
    """n O_DIRECT reads of `size` bytes (ALIGN-aligned) at random aligned offsets, qd of them in flight; the
    median of REPEATS runs (fresh offsets each)."""
    runs = sorted((_raw_reads(path, size, n, qd, seed + i) for i in range(REPEATS)), key=lambda r: r["iops"])
    return runs[len(runs) // 2]


def _raw_reads(path: str, size: int, n: int, qd: int, seed: int) -> dict:
    f = open_file(path, True)
    try:
        span = os.fstat(f.fd).st_size - size
        rng = np.random.default_rng(seed)
        offs = (rng.integers(0, max(span, 1) // ALIGN, n) * ALIGN).tolist()
        lat: list[float] = []

        def worker(chunk: list[int]) -> None:
            buf = memoryview(aligned_empty(size))
            for off in chunk:
                t = time.perf_counter()
                os.preadv(f.fd, [buf], off)
                lat.append(time.perf_counter() - t)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(qd) as ex:
            list(ex.map(worker, [offs[i::qd] for i in range(qd)]))
        dt = time.perf_counter() - t0
    finally:
        f.close()
    return {"size": size, "qd": qd, "direct": f.direct, "iops": n / dt, "mb_s": n * size / dt / 1e6,
            "lat_us": 1e6 * float(np.mean(lat))}


def ple_step_reads(path: str, rows: int, threads: int) -> dict:
    """One prefill chunk's worth of PLE rows (random, distinct) the engine's way (O_DIRECT on `threads` threads),
    with 4x the threads (a deeper queue), and the buffered way, cold."""
    from strata.host.ple_io import PleReader
    from strata.model.loader import load_model
    table = load_model(path).file.tensor("per_layer_token_embd.weight")
    pick = np.sort(np.random.default_rng(1).choice(table.shape[1], min(rows, table.shape[1]), replace=False))
    out = {}
    for name, direct, n in (("o_direct", True, threads), ("o_direct_deep", True, 4 * threads),
                            ("buffered_willneed", False, threads)):
        r = PleReader(path, table, ThreadPoolExecutor(1), direct=direct, cache_bytes=0, threads=n)
        try:
            r.read_rows(pick[:4])                     # the dequantizer's first call compiles it
            drop_file_cache(path)
            t0 = time.perf_counter()
            got = r.read_rows(pick)
            out[name] = {"ms": 1e3 * (time.perf_counter() - t0), "bytes": got.nbytes, "reads": got.reads,
                         "direct": r.file.direct}
        finally:
            r.close()
    out["rows"] = len(pick)
    return out


# ---- one configuration (a child process) ------------------------------------------------------------------------
async def one(c: dict) -> dict:
    from strata.engine import Engine, HostConfig
    from strata.host.trace import load, summarize
    from strata.sampling import SamplingParams
    budget = c["budget"]
    mapped = budget == "mapped"
    host = HostConfig(vram_budget_bytes=int(c["vram_budget_gib"] * GIB), cpu_threads=c["cpu_threads"],
                      experts=("mapped" if c["backend"] == "cpu" else "vram") if mapped else "host",
                      host_budget_bytes=None if budget in ("all", "mapped") else int(float(budget) * GIB),
                      ple_cache_bytes=int(c["ple_cache_mib"] * MIB), direct_io=not c["buffered"],
                      io_threads=c["io_threads"], step_tokens=c["step_tokens"], prefetch=c["prefetch"],
                      max_ctx=max(8192, -(-(c["prefill"] + 64) // 1024) * 1024), prefix_cache_bytes=0)
    lines: list[str] = []
    t0 = time.perf_counter()
    async with await Engine.open(c["model"], backend=c["backend"], host=host, trace=c["trace"],
                                 log=lines.append) as e:
        opened = time.perf_counter() - t0
        s = e.scheduler
        if budget == "all":
            await e.preload_experts()
        async for _ in e.generate(PROMPTS[0], SamplingParams(max_tokens=c["warmup"], stop_at_eos=False)):
            pass
        times = []
        async for _ in e.generate(PROMPTS[1], SamplingParams(max_tokens=c["tokens"], stop_at_eos=False)):
            times.append(time.perf_counter())
        prefill_s = None
        if c["prefill"]:
            rng = np.random.default_rng(5)
            prompt = rng.integers(300, e.cfg.n_vocab - 300, c["prefill"]).tolist()
            t1 = time.perf_counter()
            async for _ in e.generate(prompt, SamplingParams(max_tokens=1, stop_at_eos=False)):
                prefill_s = time.perf_counter() - t1
                break
        store = {"budget_gib": s.store.budget / GIB, "held_gib": s.store.bytes / GIB,
                 "peak_live_gib": s.store.peak_live_bytes / GIB, "mode": s.store.file.mode}
    recs = load(c["trace"])
    ids = sorted({row[0] for r in recs for row in r["rows"]})     # the warm-up, the decode, the prefill
    d = next(p for p in summarize([r for r in recs if r["rows"][0][0] == ids[1]]) if p.phase == "decode")
    pre = {}
    if prefill_s is not None:
        steps = [r for r in recs if r["rows"][0][0] == ids[2] and r["kind"] == "prefill"]
        p = next(p for p in summarize(steps) if p.phase == "prefill")
        modes = [r.get("experts_mode", "split") for r in steps]
        pre = {"prefill_tok_s": c["prefill"] / prefill_s, "prefill_steps": len(steps),
               "prefill_modes": {m: modes.count(m) for m in sorted(set(modes))},
               "prefill_ssd_gb": p.io_bytes * p.steps / 1e9, "prefill_hidden": p.io_busy_ms / p.io_ms if p.io_ms else 0.0,
               "prefill_step_ms": p.ms["total"],
               "prefill_parts_ms": {k: round(v, 1) for k, v in sorted(p.ms.items(), key=lambda kv: -kv[1]) if v >= 1}}
    dec = (times[-2] - times[0]) / (len(times) - 2)            # between generated tokens (the last is the finish)
    distinct = d.hits + d.ram_hits + d.ssd_reads
    ssd_bytes = d.io_bytes * d.steps
    return {"budget": budget, "open_line": lines[0], "open_s": opened,
            "decode_ms": dec * 1e3, "tok_s": 1 / dec, "tokens": d.tokens,
            "vram": d.hits / max(distinct, 1), "ram": d.ram_hits / max(distinct, 1),
            "ssd": d.ssd_reads / max(distinct, 1), "distinct_per_token": distinct / d.tokens,
            "ple_hit": d.ple_hits / max(d.ple_rows, 1),
            "ssd_kb_token": ssd_bytes / d.tokens / 1e3,
            "expert_kb_token": d.expert_ssd_bytes * d.steps / d.tokens / 1e3,
            "ple_kb_token": d.ple_ssd_bytes * d.steps / d.tokens / 1e3,
            "ssd_ms_token": d.io_ms * d.steps / d.tokens,
            "read_mb_s": ssd_bytes / (d.io_ms * d.steps * 1e-3) / 1e6 if d.io_ms else 0.0,
            "hidden": d.io_busy_ms / d.io_ms if d.io_ms else 0.0,
            "exposed_ms_token": d.io_exposed_ms * d.steps / d.tokens,
            "peak_rss": peak_rss_bytes(), "store": store, **pre}


def drop_caches(path: str) -> None:
    """The file's pages out of the page cache, and the whole page cache where this process may (root)."""
    drop_file_cache(path)
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        pass


def run_child(a: argparse.Namespace, budget: str) -> dict:
    drop_caches(a.model)
    with tempfile.NamedTemporaryFile(prefix="strata-tiers-", suffix=".jsonl", delete=False) as t:
        trace = t.name
    c = {"model": a.model, "backend": a.backend, "vram_budget_gib": a.vram_budget_gib, "budget": budget,
         "ple_cache_mib": a.ple_cache_mib, "tokens": a.tokens, "warmup": a.warmup, "cpu_threads": a.cpu_threads,
         "io_threads": a.io_threads, "buffered": a.buffered, "trace": trace, "prefill": a.prefill,
         "step_tokens": a.step_tokens, "prefetch": a.prefetch}
    try:
        r = subprocess.run([sys.executable, __file__, "--model", a.model, "--child", json.dumps(c)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"budget {budget}: the run failed:\n{r.stderr[-3000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        os.unlink(trace)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.child:
        import uvloop
        print(json.dumps(uvloop.run(one(json.loads(a.child)))))
        return 0
    from strata.host.experts import ExpertLayout
    from strata.model.loader import load_model
    m = load_model(a.model)
    cfg, layout = m.cfg, ExpertLayout.from_model(m)
    blob = layout.blob_bytes(0)
    all_experts = sum(layout.blob_bytes(il) for il in range(cfg.n_layer)) * cfg.n_expert
    print(f"model: {a.model} ({os.path.getsize(a.model) / GIB:.3f} GiB; {cfg.n_layer} layers, {cfg.n_expert} experts "
          f"top-{cfg.n_expert_used}, blob {blob / 1e3:.1f} kB, all experts {all_experts / GIB:.3f} GiB); backend "
          f"{a.backend}; PLE cache {a.ple_cache_mib:g} MiB; reads {'buffered' if a.buffered else 'O_DIRECT'}, "
          f"{a.io_threads} in flight; prefetch {a.prefetch}")
    out: dict = {"model": a.model, "raw": [], "configs": []}
    if a.raw_reads:
        span = align_up(max(sl.nbytes for sl in layout.layers[0])) + ALIGN     # one slice's span, as the store reads
        print(f"disk (O_DIRECT random reads on the model file, {a.raw_reads} each, median of {REPEATS} runs):")
        for size in (ALIGN, span):
            for qd in (1, 32):
                r = raw_reads(a.model, size, a.raw_reads, qd)
                out["raw"].append(r)
                print(f"  {size / 1024:7.1f} KiB  QD {qd:2d}: {r['iops']:9.0f} IOPS  {r['mb_s']:8.1f} MB/s  mean "
                      f"latency {r['lat_us']:8.1f} us" + ("" if r["direct"] else "  (O_DIRECT refused: buffered)"))
        if cfg.ple_layers:
            p = ple_step_reads(a.model, 512 * cfg.ple_heads, a.io_threads)
            out["ple_step"] = p
            print(f"  a 512-token chunk's PLE rows ({p['rows']} distinct, cold): O_DIRECT on {a.io_threads} threads "
                  f"{p['o_direct']['ms']:.1f} ms ({p['o_direct']['bytes'] / 1e6:.2f} MB in {p['o_direct']['reads']} "
                  f"reads), on {4 * a.io_threads} threads {p['o_direct_deep']['ms']:.1f} ms; buffered WILLNEED + "
                  f"pread {p['buffered_willneed']['ms']:.1f} ms")
    raw = {(r["size"], r["qd"]): r["mb_s"] for r in out["raw"]}
    print(f"{'RAM tier':>9s} {'ms/tok':>8s} {'tok/s':>7s} {'VRAM':>6s} {'RAM':>6s} {'SSD':>6s} {'PLE hit':>7s} "
          f"{'SSD kB/tok':>10s} {'(experts':>9s} {'PLE)':>6s} {'read MB/s':>9s} {'hidden':>7s} {'exposed':>8s} "
          f"{'peak RSS':>9s}")
    for budget in [b.strip() for b in a.host_budgets.split(",") if b.strip()]:
        r = run_child(a, budget)
        out["configs"].append(r)
        label = budget if budget in ("all", "mapped") else f"{float(budget):g} GiB"
        print(f"{label:>9s} {r['decode_ms']:8.2f} {r['tok_s']:7.2f} {100 * r['vram']:5.1f}% {100 * r['ram']:5.1f}% "
              f"{100 * r['ssd']:5.1f}% {100 * r['ple_hit']:6.1f}% {r['ssd_kb_token']:10.1f} "
              f"{r['expert_kb_token']:9.1f} {r['ple_kb_token']:6.1f} {r['read_mb_s']:9.1f} {100 * r['hidden']:6.1f}% "
              f"{r['exposed_ms_token']:6.2f}ms {r['peak_rss'] / MIB:7.1f}Mi")
    for r in out["configs"]:
        if "prefill_tok_s" in r:
            print(f"  [{r['budget']}] prefill {a.prefill} tokens: {r['prefill_tok_s']:.1f} tok/s, {r['prefill_steps']} steps "
                  f"{r['prefill_modes']}, {r['prefill_step_ms']:.0f} ms a step, SSD {r['prefill_ssd_gb']:.2f} GB "
                  f"({100 * r['prefill_hidden']:.0f}% hidden); per step ms: {r['prefill_parts_ms']}")
    for r in out["configs"]:
        st = r["store"]
        print(f"  [{r['budget']}] {r['open_line']}; RAM tier held {st['held_gib'] * 1024:.1f} MiB of "
              f"{st['budget_gib'] * 1024:.1f}, blobs alive at most {st['peak_live_gib'] * 1024:.1f} MiB")
    if raw:
        print("read MB/s: achieved while a read was in flight during decode; the disk's limits above: "
              + ", ".join(f"{s / 1024:g} KiB QD{q} {v:.0f}" for (s, q), v in raw.items()))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
