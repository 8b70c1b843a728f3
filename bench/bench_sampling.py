"""The sampler's cost per token over a vocabulary the size of the flash model's (248,320): a Sampler drawing from
random logits, plain (flat) or scaled by 10 (peaked, as a trained model's), for greedy and the usual filters;
median of --reps calls after 3 warm-up calls. Host work on every decode step that samples; so is the next
token's PLE hash (ple_rows of one token at the flash geometry's 16 heads), timed last.

    python bench/bench_sampling.py [--vocab 248320] [--reps 15]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.model.synth import preset_config  # noqa: E402
from strata.reference.ple import NgramWindow, ple_rows  # noqa: E402
from strata.sampling import Sampler, SamplingParams  # noqa: E402

CASES = [("peaked (N(0,1) x 10), t 0.7, top_p 0.9", 10, dict(temperature=0.7, top_p=0.9)),
         ("peaked, t 1, top_p 0.95, min_p 0.05", 10, dict(temperature=1.0, top_p=0.95, min_p=0.05)),
         ("N(0,1), t 0.7", 1, dict(temperature=0.7)),
         ("N(0,1), t 0.7, top_k 40", 1, dict(temperature=0.7, top_k=40)),
         ("N(0,1) (flat), t 0.7, top_p 0.9", 1, dict(temperature=0.7, top_p=0.9)),
         ("greedy", 1, dict())]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    z = np.random.default_rng(0).standard_normal(a.vocab).astype(np.float32)
    print(f"sampler, vocabulary {a.vocab}: median ms a token of {a.reps} calls after 3")
    for name, scale, kw in CASES:
        s, zz = Sampler(SamplingParams(seed=1, **kw)), z * scale
        for _ in range(3):
            s(zz)
        ts = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            s(zz)
            ts.append(time.perf_counter() - t0)
        print(f"  {name:44s} {np.median(ts) * 1e3:8.2f}")
    cfg, window = preset_config("flash"), NgramWindow((5, 7))
    ts = []
    for i in range(100 * a.reps):
        t0 = time.perf_counter()
        ple_rows(cfg, [1000 + i], window)
        ts.append(time.perf_counter() - t0)
    print(f"  {'PLE rows of one token (flash, 16 heads)':44s} {np.median(ts) * 1e3:8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
