"""Time to first token with and without prefix reuse: a shared prefix, then requests that extend it.

    python bench/bench_prefix.py --model models/small.gguf --prefix 2000 --suffix 16

One engine per mode (HostConfig.prefix_cache_bytes: the default, or 0). A warm-up request feeds the prefix once
(its snapshot is what the others resume from); then --repeats requests, each the prefix plus its own --suffix
random tokens, greedy, one token each: their time to first token, median. Same machine, same run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.engine import Engine, HostConfig  # noqa: E402  (after the path line: runs from a checkout)
from strata.sampling import SamplingParams  # noqa: E402


async def ttft(model: str, prefix: list[int], suffixes: list[list[int]], budget: int) -> list[float]:
    one = SamplingParams(max_tokens=1, stop_at_eos=False)
    async with await Engine.open(model, host=HostConfig(prefix_cache_bytes=budget)) as e:
        await e.preload_experts()
        async for _ in e.generate(prefix, one):                      # warm-up: feeds the prefix once
            pass
        out = []
        for s in suffixes:
            t0 = time.perf_counter()
            async for _ in e.generate(prefix + s, one):
                out.append(time.perf_counter() - t0)
                break
        reused = e.scheduler.prefixes.tokens_reused if e.scheduler.prefixes else 0
    print(f"  prefix cache {budget / 2**20:.0f} MiB: {reused} prompt tokens reused", file=sys.stderr)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="GGUF file")
    p.add_argument("--prefix", type=int, default=2000, help="shared prefix tokens (default 2000)")
    p.add_argument("--suffix", type=int, default=16, help="each request's own tokens after it (default 16)")
    p.add_argument("--repeats", type=int, default=5, help="requests measured per mode (default 5)")
    a = p.parse_args()
    import uvloop
    from strata.model.loader import load_model
    cfg = load_model(a.model).cfg
    rng = np.random.default_rng(0)
    draw = lambda n: [int(t) if t != cfg.eos_id else int(t) + 1 for t in rng.integers(300, cfg.n_vocab - 300, n)]
    prefix, suffixes = draw(a.prefix), [draw(a.suffix) for _ in range(a.repeats)]
    res = {}
    for label, budget in (("without reuse", 0), ("with reuse", HostConfig().prefix_cache_bytes)):
        res[label] = float(np.median(uvloop.run(ttft(a.model, prefix, suffixes, budget))))
    print(f"| prompt | without reuse | with reuse | speed-up |\n|---|---|---|---|\n"
          f"| {a.prefix} shared + {a.suffix} own tokens | {res['without reuse'] * 1e3:.1f} ms | "
          f"{res['with reuse'] * 1e3:.1f} ms | {res['without reuse'] / res['with reuse']:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
