"""Where a batched prefill step's time goes on the GPU (every weight in VRAM): a prompt fed in chunks of T rows
through the CUDA backend's batched path, each chunk stage by stage with an event between stages (eager launches,
so the parts sum to the total; the captured whole-step graph is timed too, on the same chunk sizes). --launches
adds a third pass with an event after every launch: ms per chunk by stage and launch name summed over the layers
(which GEMM, the GDN scan, QSA attention), the largest first.

    python3 bench/bench_prefill_gpu.py [--model models/flash.gguf] [--chunks 512,4096] [--tokens 8192]

Prints per chunk size: the whole-step graph's ms per chunk and tok/s (median over the chunks after a warm-up
chunk), and the per-stage ms per chunk summed over the layers of each kind (gdn / qsa), whose sum is given next
to the eager total. Random weights; attention cost grows with the position, so the chunks are fed in order.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from strata.cuda.backend import CudaBackend
    from strata.host.backend import Segment, Step
    from strata.model.loader import load_model
    from strata.reference.ple import NgramWindow, ple_gather, ple_rows

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="models/flash.gguf")
    ap.add_argument("--chunks", default="512,4096", help="rows per step")
    ap.add_argument("--tokens", type=int, default=8192, help="prompt tokens fed per chunk size")
    ap.add_argument("--launches", type=int, default=0, metavar="N",
                    help="also time every launch alone and print the N largest (0: not)")
    a = ap.parse_args()
    model = load_model(a.model)
    cfg, W = model.cfg, model.weights
    sizes = [int(c) for c in a.chunks.split(",")]
    be = CudaBackend(model, experts="vram", max_ctx=a.tokens + 256, step_tokens=max(sizes), log=print)
    rng = np.random.default_rng(0)
    try:
        for T in sizes:
            for mode in ("whole", "stages") + (("launches",) if a.launches else ()):
                seq = be.new_seq()
                window = NgramWindow.start(cfg) if cfg.ple_layers else None
                times, stages = [], defaultdict(float)
                n_chunks = a.tokens // T
                for c in range(n_chunks):
                    toks = tuple(int(t) for t in rng.integers(0, cfg.n_vocab, T))
                    step = Step((Segment(seq, toks, seq.pos),))
                    e = None
                    if window is not None:
                        e = ple_gather(W.per_layer_token_embd, ple_rows(cfg, toks, window))
                        window.advance_all(cfg, toks)
                    if mode != "whole":
                        got = be.timed_step(step, e, per_launch=mode == "launches")
                        if c:                                   # the first chunk is the warm-up
                            for label, ms in got:
                                stages[label] += ms / (n_chunks - 1)
                            times.append(sum(ms for _, ms in got))
                        continue
                    be.stream.synchronize("bench")
                    t0 = time.perf_counter()
                    be.launch_whole(step, e)
                    while be.poll_logits() is None:
                        pass
                    if c:
                        times.append((time.perf_counter() - t0) * 1e3)
                be.free_seq(seq)
                med = float(np.median(times))
                print(f"chunk {T:5d} {mode:6s}: {med:8.2f} ms per chunk, {T / med * 1e3:8.1f} tok/s "
                      f"(median of {len(times)} chunks after a warm-up, positions 0-{n_chunks * T})", flush=True)
                if mode != "whole":
                    shown = sorted(stages.items(), key=lambda kv: -kv[1])
                    if mode == "launches":
                        shown = shown[:a.launches]
                    total = sum(stages.values())
                    for label, ms in shown:
                        print(f"    {label:32s} {ms:8.2f} ms  {ms / total * 100:5.1f}%")
                    rest = total - sum(ms for _, ms in shown)
                    if rest:
                        other = f"the other {len(stages) - len(shown)}"
                        print(f"    {other:32s} {rest:8.2f} ms  {rest / total * 100:5.1f}%")
                    print(f"    {'sum':32s} {total:8.2f} ms (the eager total per chunk)")
    finally:
        be.close()


if __name__ == "__main__":
    main()
