"""Python's cyclic collector during requests, with and without Engine(freeze_gc): the collections the trace
recorded inside steps (every thread stops while one runs), their pause time per step and the longest, per step
kind; then one full collection's time with the engine open. Each setting in its own process (a freeze lasts the
process).

    python3 bench/bench_gc.py --model models/small.gguf [--backend cpu|cuda] [--requests 3] [--prompt 400]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def child(a) -> None:
    from strata.engine import Engine
    from strata.host.trace import load, summarize
    from strata.sampling import SamplingParams
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "trace.jsonl")
        async with await Engine.open(a.model, backend=a.backend, trace=path, freeze_gc=a.freeze == "on") as e:
            prompt = list(range(300, 300 + a.prompt))
            for _ in range(a.requests):
                async for _ in e.generate(prompt, SamplingParams(max_tokens=a.tokens, stop_at_eos=False)):
                    pass
            t0 = time.perf_counter()
            gc.collect()
            full = (time.perf_counter() - t0) * 1e3
            tracked = len(gc.get_objects())
        for p in summarize(load(path)):
            print(f"freeze {a.freeze}: {p.phase:7s} {p.steps:4d} steps, {p.ms['total']:9.3f} ms/step; collector "
                  f"{p.gc_n} runs, {p.gc_ms:.3f} ms/step, the longest {p.gc_max_ms:.3f} ms")
        print(f"freeze {a.freeze}: one full collection with the engine open {full:.3f} ms ({tracked} objects "
              f"tracked, {gc.get_freeze_count()} frozen)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/small.gguf")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=400, help="prompt tokens a request")
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens a request")
    ap.add_argument("--freeze", choices=["on", "off"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.freeze:
        asyncio.run(child(a))
        return
    for f in ("off", "on"):
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--freeze", f], check=True)


if __name__ == "__main__":
    main()
