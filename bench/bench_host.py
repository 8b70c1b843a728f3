"""Host scheduler benchmark: decode a fixed number of tokens through the step loop and print where the time went.

    python bench/bench_host.py --model flash.gguf --backend cuda --vram-budget-gib 24 --tokens 64 --trace t.jsonl

Prints decode ms/token and tok/s, the VRAM cache hit rate, the trace breakdown of the measured request (the same
table as `cli.py trace`), the Python host overhead per token and the expert bandwidth achieved. A warm-up request
runs first (numba compilation, first reads, cache fill); --preload reads every expert into host memory before it;
--profile N runs one more request under cProfile and lists where the loop thread's Python time went.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.engine import Engine, HostConfig  # noqa: E402  (after the path line: runs from a checkout)
from strata.host.backend import MAPPED_READS  # noqa: E402
from strata.host.trace import format_summary, last_request, load, summarize  # noqa: E402
from strata.sampling import SamplingParams  # noqa: E402

GIB = 1 << 30


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="GGUF file")
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--vram-budget-gib", type=float, default=24.0, help="VRAM expert cache budget (default 24)")
    p.add_argument("--host-budget-gib", type=float, default=None,
                   help="expert blobs kept in RAM (default: all experts, at most half the RAM)")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens measured (default 64)")
    p.add_argument("--warmup", type=int, default=8, help="tokens of the warm-up request (default 8)")
    p.add_argument("--prompt", default="The lighthouse stood at the end of a long stone pier")
    p.add_argument("--cpu-threads", type=int, default=None, help="CPU expert pool threads (default: one per core)")
    p.add_argument("--preload", action="store_true", help="read every expert into host memory first")
    p.add_argument("--map-experts", default="auto", choices=["auto", "always", "never"],
                   help="HostConfig.map_experts: decode rows as one graph reading VRAM misses from host memory")
    p.add_argument("--mapped-reads", default="prefetch", choices=list(MAPPED_READS),
                   help="HostConfig.mapped_reads: a mapped token's misses copied into VRAM by a kernel on every SM "
                        "first (fetch; prefetch: also the next layer's predicted misses a layer early), or read over PCIe by the "
                        "expert kernels (direct)")
    p.add_argument("--prefetch-extra", type=int, default=0,
                   help="HostConfig.prefetch_extra: experts a prefetch's prediction keeps beyond the top k")
    p.add_argument("--cache-half-life", type=int, default=None, metavar="TOKENS",
                   help="HostConfig.cache_half_life: the half-life in tokens of the routes the VRAM cache ranks "
                        "experts by (default: the engine's)")
    p.add_argument("--trace", help="write the JSON-lines trace here (default: a temporary file)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the measured request, run one more of the same length under cProfile (the loop's "
                        "thread; every Python call costs more there, so read it for where the host work is, not for "
                        "how long) and print its N costliest functions by own time and by cumulative time "
                        "(default: 0, off)")
    a = p.parse_args(argv)
    if a.tokens < 2:
        p.error("--tokens must be at least 2 (decode speed is measured between tokens)")
    return a


async def preload(e: Engine) -> None:
    t0 = time.perf_counter()
    n = await e.preload_experts()
    s = e.scheduler
    print(f"preload: {n / GIB:.2f} GiB of experts in {time.perf_counter() - t0:.1f} s, "
          f"{len(s.store)} blobs held ({s.store.bytes / GIB:.2f} GiB)")


async def run(a: argparse.Namespace, trace: str) -> None:
    host = HostConfig(vram_budget_bytes=int(a.vram_budget_gib * GIB),
                      host_budget_bytes=None if a.host_budget_gib is None else int(a.host_budget_gib * GIB),
                      cpu_threads=a.cpu_threads, map_experts=a.map_experts, mapped_reads=a.mapped_reads,
                      prefetch_extra=a.prefetch_extra,
                      **({} if a.cache_half_life is None else {"cache_half_life": a.cache_half_life}))
    t0 = time.perf_counter()
    async with await Engine.open(a.model, backend=a.backend, host=host, trace=trace) as e:
        s, cfg = e.scheduler, e.cfg
        print(f"model: {a.model} ({cfg.n_layer} layers, {cfg.n_expert} experts top-{cfg.n_expert_used}, "
              f"E {cfg.n_embd}); backend {e.backend.name}, {s.cache.slots} VRAM expert slots, budget "
              f"{a.vram_budget_gib:g} GiB; host store {s.store.budget / GIB:.1f} GiB; CPU pool {s.pool.n_threads} "
              f"threads; opened in {time.perf_counter() - t0:.1f} s")
        if a.preload:
            await preload(e)
        async for _ in e.generate(a.prompt, SamplingParams(max_tokens=a.warmup, stop_at_eos=False)):
            pass
        hits0, looks0 = sum(s.cache.hits.values()), sum(s.cache.lookups.values())
        times = []
        async for c in e.generate(a.prompt, SamplingParams(max_tokens=a.tokens, stop_at_eos=False)):
            times.append(time.perf_counter())
        hits, looks = sum(s.cache.hits.values()) - hits0, sum(s.cache.lookups.values()) - looks0
        e.flush_trace()
        report(a, s, trace, c, times, hits, looks)
        if a.profile:             # another request of the same length, under the profiler (after the report: the
            prof = cProfile.Profile()           # trace's last request is the measured one until then)
            prof.enable()
            async for _ in e.generate(a.prompt, SamplingParams(max_tokens=a.tokens, stop_at_eos=False)):
                pass
            prof.disable()
            for key in ("tottime", "cumulative"):
                print(f"profile of a second request of {a.tokens} tokens, the {a.profile} costliest by {key}:")
                pstats.Stats(prof, stream=sys.stdout).strip_dirs().sort_stats(key).print_stats(a.profile)
            # what the launch and the step's bookkeeping call, driver calls included (a launch's time is the
            # host's between two tokens: which of its parts is Python and which the driver's)
            stats = pstats.Stats(prof, stream=sys.stdout).strip_dirs().sort_stats("cumulative")
            for fn in ("launch_whole", "_sync_ptab", "_stage_token", "_after_rows", "_forward_mapped"):
                stats.print_callees(fn)


def report(a: argparse.Namespace, s, trace: str, c, times: list[float], hits: int, looks: int) -> None:
    """The measured request's figures: decode speed, cache hits, the trace's table and the host overhead."""
    gaps = np.diff(times[:-1])                 # between generated tokens (the last chunk is the finish)
    dec = float(np.median(gaps))
    t = c.timings
    print(f"prefill: {c.prompt_tokens} tokens, {t.prefill_tok_s:.1f} tok/s")
    print(f"decode: {a.tokens} tokens, {dec * 1e3:.3f} ms/token median ({1 / dec:.2f} tok/s), mean "
          f"{gaps.mean() * 1e3:.3f}")
    print(f"VRAM expert cache: hit rate {hits / looks if looks else 0:.1%} in the measured request "
          f"({hits}/{looks}), {s.cache.uploads} uploads in all, {len(s.cache)} experts resident "
          f"({s.cache.bytes / GIB:.2f} GiB)")
    recs = load(trace)
    phases = summarize(last_request(recs))                         # the last request is the measured one
    print(format_summary(phases))
    d = next((p for p in phases if p.phase == "decode"), None)
    if d is not None:             # one request: a decode step is one token
        print(f"host overhead: {d.host_ms:.3f} ms/token ({d.host_ms / d.ms['total']:.1%} of the wall); experts "
              f"{d.expert_bytes / 1e6:.1f} MB/token at {d.expert_bytes / d.ms['total'] / 1e6:.2f} GB/s"
              + (f", read in place from host memory {d.mapped_bytes / d.steps / 1e6:.1f} MB/token"
                 if d.mapped_steps else ""))
    print(f"trace: {trace}")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    import uvloop
    trace = a.trace or tempfile.NamedTemporaryFile(prefix="strata-trace-", suffix=".jsonl", delete=False).name
    uvloop.run(run(a, trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
