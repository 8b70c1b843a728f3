"""Prefill under a VRAM budget, streamed against split (issue 12): one prompt fed in chunks of --step-tokens through
the engine with experts in host memory (every expert preloaded into the RAM tier, so the disk is out of it), once
with every chunk's experts streamed (`stream_experts="always"`) and once split between the CPU pool and uploads
("never"), each after a warm-up prompt; from the trace, per mode: tok/s, ms per chunk and its parts (the trace's
spans, summing to the wall), and for the streamed run each layer's copy time on the device, the part of it post[l]
waited for, and the share hidden behind compute.

    python3 bench/bench_stream.py --model models/flash.gguf --tokens 4096 --step-tokens 512     # the GPU machine
    python bench/bench_stream.py --model models/small.gguf --backend cpu --tokens 256          # the CPU twin

On the CPU backend the twin (CpuBackend(stream=True)) streams: its copies are host memory copies with no device
time, so its copy and hidden columns are zeros; it checks the script, not the GPU's overlap.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def run(a, mode: str, trace: str) -> tuple[float, dict]:
    from strata.engine import Engine, HostConfig
    from strata.host.backend import CpuBackend
    from strata.model.loader import load_model
    from strata.sampling import SamplingParams
    host = HostConfig(vram_budget_bytes=int(a.vram_budget_gib * (1 << 30)), experts="host",
                      step_tokens=a.step_tokens, stream_experts=mode, prefix_cache_bytes=0,
                      max_ctx=-(-(a.tokens + 64) // 1024) * 1024)
    if a.backend == "cpu":
        model = load_model(a.model)
        eng = Engine(model, backend=CpuBackend(model, stream=True), host=host, trace=trace,
                     freeze_gc=a.gc_freeze == "on")
    else:
        eng = await Engine.open(a.model, backend="cuda", host=host, trace=trace, freeze_gc=a.gc_freeze == "on")
    try:
        await eng.preload_experts()
        rng = np.random.default_rng(3)
        vocab = eng.cfg.n_vocab
        one = SamplingParams(max_tokens=1, stop_at_eos=False)
        async for _ in eng.generate(rng.integers(300, vocab - 300, min(a.tokens, a.step_tokens)).tolist(), one):
            pass                                                      # warm-up: kernels, graphs, both size classes
        prompt = rng.integers(300, vocab - 300, a.tokens).tolist()
        t0 = time.perf_counter()
        async for _ in eng.generate(prompt, one):
            break
        wall = time.perf_counter() - t0
        return wall, dict(eng.scheduler.chunk_modes)
    finally:
        await eng.aclose()


def report(mode: str, wall: float, trace: str, a) -> None:
    from strata.host.trace import load
    recs = [r for r in load(trace) if r["kind"] == "prefill"]
    ids = sorted({r["rows"][0][0] for r in recs})
    steps = [r for r in recs if r["rows"][0][0] == ids[-1]]          # the measured prompt's chunks
    spans = defaultdict(float)
    for r in steps:
        spans["total"] += r["t1"] - r["t0"]
        for kind, _, t0, t1 in r["spans"]:
            spans[kind] += t1 - t0
    n = len(steps)
    parts = {k: v / n for k, v in sorted(spans.items(), key=lambda kv: -kv[1]) if k != "total"}
    modes = sorted({r.get("experts_mode", "split") for r in steps})
    print(f"{mode}: {a.tokens / wall:.1f} tok/s ({a.tokens} tokens, {n} chunks of <= {a.step_tokens}, modes "
          f"{modes}); ms per chunk {spans['total'] / n:.1f} = " + " + ".join(f"{k} {v:.1f}" for k, v in parts.items()
                                                                             if v >= 0.05)
          + f" + other {spans['total'] / n - sum(parts.values()):.1f}")
    pauses = [t1 - t0 for r in steps for _, t0, t1 in r.get("gc", ())]
    print(f"  Python's collector (gc freeze {a.gc_freeze}): {len(pauses) / n:.0f} runs a chunk, pausing every thread "
          f"{sum(pauses) / n:.2f} ms a chunk, the longest {max(pauses, default=0.0):.2f} ms")
    layers = defaultdict(lambda: [0.0] * 10)     # the stream tuple's 8 values, then the host's two waits
    host = {"stream_wait": 8, "lag_wait": 9}     # lag_wait's layer: the post the host waited for
    for r in steps:
        for layer, *vals in r.get("stream", []):
            layers[layer][:8] = [x + v for x, v in zip(layers[layer], vals)]
        for kind, layer, t0, t1 in r["spans"]:
            if kind in host and layer >= 0:
                layers[layer][host[kind]] += t1 - t0
    if layers:
        print(f"  per layer, per chunk: {'layer':>5s} {'experts':>8s} {'MB':>8s} {'copy ms':>8s} {'exposed':>8s} "
              f"{'hidden':>7s} {'pre ms':>7s} {'post ms':>7s} {'idle ms':>7s} {'drv ms':>7s} {'enqueue':>7s} "
              f"{'lag':>7s}")
        print(f"  {'':21s}(device: copies, their part post waited for, pre, post, the idle gap before pre; host: "
              f"the time inside the backend's calls enqueueing the copies, the wait for them to be enqueued, the "
              f"wait for this layer's post before launching pre[l + 2])")
        tot = [0.0] * 10

        def row(label, k, nbytes, copy, exposed, pre, post, idle, drv, enq, lag, tail=""):
            print(f"  {'':21s}{label:>5} {k / n:8.0f} {nbytes / n / 1e6:8.1f} {copy / n:8.2f} {exposed / n:8.2f} "
                  f"{100 * (1 - exposed / copy) if copy else 0:6.1f}% {pre / n:7.2f} {post / n:7.2f} {idle / n:7.2f}"
                  f" {drv / n:7.2f} {enq / n:7.2f} {lag / n:7.2f}" + tail)
        for layer in sorted(layers):
            tot = [t + v for t, v in zip(tot, layers[layer])]
            if a.all_layers or layer < 3 or layer >= max(layers) - 1:
                row(layer, *layers[layer])
        rate = tot[1] / (tot[2] * 1e-3) / 1e9 if tot[2] else 0.0
        row("all", *tot, tail=f"   ({rate:.1f} GB/s while copying; the device computed {(tot[4] + tot[5]) / n:.1f} "
                              f"ms a chunk and idled {tot[6] / n:.1f} between layers)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="models/flash.gguf")
    ap.add_argument("--backend", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--vram-budget-gib", type=float, default=24.0)
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens measured")
    ap.add_argument("--step-tokens", type=int, default=512, help="rows a chunk")
    ap.add_argument("--modes", default="always,never", help="stream_experts settings, each its own engine")
    ap.add_argument("--all-layers", action="store_true", help="every layer's row (default: the first 3, last 2)")
    ap.add_argument("--gc-freeze", default="on", choices=["on", "off"],
                    help="Engine(freeze_gc=...): off shows what the collector's full passes cost")
    a = ap.parse_args()
    import uvloop
    for mode in a.modes.split(","):
        fd, trace = tempfile.mkstemp(prefix="strata-stream-", suffix=".jsonl")
        os.close(fd)
        try:
            wall, _ = uvloop.run(run(a, mode, trace))
            report(mode, wall, trace, a)
        finally:
            os.unlink(trace)


if __name__ == "__main__":
    main()
