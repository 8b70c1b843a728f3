"""The VRAM expert cache's promotion rule, replayed on the calibrated flash routing: hit rate and copies a token.

    python bench/sim_cache.py [--tokens 1536] [--fraction 0.364] [--half-life 512] [--prompt 0] [--skew 0.2286]

Routes: a small realistic file's router inputs (made here, run by the CPU reference over English text) routed
through 48 fresh random routers of flash's 512 experts top-10 with its calibrated skew (calibrate_routing.py's
replay: top-k depends only on the direction of the router's input), the small file's layers reused in turn. The
cache holds `fraction` of the 48 x 512 experts (0.364: the 8,948 slots the CUDA backend had under the 24 GiB budget
on the H100, bench/RESULTS.md "twelfth session") and starts empty, or, with --prompt N, filled as a streamed
prompt of the first N tokens fills it (free slots in layer order) with those routes counted. Then every token is a
mapped token: its hits made most recently used, then its misses promoted by one of the rules

  ranked       the engine's (strata.host.experts.VramCache.promotions, run here): routes counted with the
               half-life, misses most popular first, into a free slot or over the least recently used expert only
               when it is less popular
  second-miss  the rule before: LRU, an expert promoted once mapped tokens have missed it twice since its last
               promotion
  every-miss   LRU, every miss promoted

and the table gives the hit rate and the copies a token in windows of the decode, beside an oracle (the window's
most routed experts held all along, no copies). Random weights route almost uniformly; the calibrated skew is what
makes these files' routing cacheable (bench/RESULTS.md, routing section).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import calibrate_routing as cr  # noqa: E402
from strata.host.experts import VramCache  # noqa: E402
from strata.model.loader import load_model  # noqa: E402
from strata.model.synth import PRESETS, ROUTING_SKEW, make_model  # noqa: E402

RULES = ("ranked", "second-miss", "every-miss")


def flash_routes(tokens: int, folder: str, skew: float) -> np.ndarray:
    """(48, tokens, 10) expert ids of the replayed flash routing at `skew` (0: the uniform routing of random
    weights)."""
    path = Path(folder) / "small-realistic.gguf"
    make_model("small", path, seed=0, routing="realistic", log=lambda s: None)
    rec = cr.record(load_model(path), tokens, keep_inputs=True)
    inputs = np.stack([np.concatenate(c) for c in rec.inputs])              # (8, tokens, 256)
    f = PRESETS["flash"]
    return np.stack([cr.replay_ids(inputs[il % len(inputs)][None], f["n_expert"], f["n_expert_used"],
                                   skew, seed=il)[0] for il in range(f["n_layer"])])


def replay(ids: np.ndarray, rule: str, slots: int, half_life: float, prompt: int, windows) -> list[tuple]:
    """Per window (a, b): (hit rate, copies a token) of mapped tokens a .. b - 1 after the prompt."""
    n_layer, T, k = ids.shape
    cache = VramCache(slots, slots, n_layer, int(ids.max()) + 1, half_life)      # one byte a blob
    missed = np.zeros(cache.score.shape, np.int32)
    if prompt:
        cache.tick(prompt)
        for il in range(n_layer):
            per = np.bincount(ids[il, :prompt].reshape(-1), minlength=cache.score.shape[1])
            used = np.flatnonzero(per)
            cache.record(il, used, np.zeros(len(used), bool), per[used])
            for e in used.tolist():
                cache.place(il, e, 1, set(), evict=False)
    out = []
    for a, b in windows:
        hits = looks = copies = 0
        for t in range(prompt + a, min(prompt + b, T)):
            row = ids[:, t]
            res = np.array([[(il, e) in cache._lru for e in row[il].tolist()] for il in range(n_layer)])
            cache.tick(1)
            cache.count_token(row, res)
            hits, looks = hits + int(res.sum()), looks + res.size
            if rule == "ranked":                    # the engine's own rule (Scheduler._promote)
                copies += sum(1 for _ in cache.promotions(row, res, [1] * n_layer))
                continue
            cache.touch_token(row, res)
            for il in range(n_layer):
                miss = row[il][~res[il]]
                missed[il, miss] += 1
                miss = miss[missed[il, miss] >= (2 if rule == "second-miss" else 1)]
                keep = set(row[il].tolist())
                for e in miss.tolist():
                    if cache.place(il, e, 1, keep) is None:
                        break
                    missed[il, e] = 0
                    copies += 1
        n = max(1, min(prompt + b, T) - prompt - a)
        out.append((hits / max(looks, 1), copies / n))
    return out


def oracle(ids: np.ndarray, slots: int, prompt: int, windows) -> list[float]:
    """Per window: the hit rate of a static cache of that window's `slots` most routed (layer, expert) pairs."""
    n_layer, T, _ = ids.shape
    n_expert = int(ids.max()) + 1
    out = []
    for a, b in windows:
        w = ids[:, prompt + a:min(prompt + b, T)]
        counts = np.stack([np.bincount(w[il].reshape(-1), minlength=n_expert) for il in range(n_layer)]).ravel()
        out.append(float(np.sort(counts)[::-1][:slots].sum() / max(counts.sum(), 1)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1536, help="tokens of routing replayed (prompt included)")
    p.add_argument("--fraction", type=float, default=0.364, help="the cache's share of the experts")
    p.add_argument("--half-life", type=float, default=512, help="the ranked rule's half-life in tokens")
    p.add_argument("--prompt", type=int, default=0, help="tokens of a streamed prompt first (0: an empty cache)")
    p.add_argument("--skew", type=float, default=ROUTING_SKEW["flash"],
                   help="the routers' skew (default: flash's calibrated realistic routing; 0: uniform routing)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        ids = flash_routes(a.tokens, d, a.skew)
    n_layer, T, k = ids.shape
    slots = round(a.fraction * n_layer * int(ids.max() + 1))
    n = T - a.prompt
    windows = [w for w in ((0, 64), (64, 192), (192, 512), (512, n)) if w[0] < n]
    print(f"{n_layer} layers x {int(ids.max()) + 1} experts top-{k}, {slots} slots ({a.fraction:.1%}), "
          f"{a.prompt} prompt tokens then {n} mapped tokens; skew {a.skew:g}, half-life {a.half_life:g} tokens")
    print(f"{'rule':<12} " + " ".join(f"{f'tokens {w0}-{min(w1, n)}':>22}" for w0, w1 in windows))
    for rule in RULES:
        got = replay(ids, rule, slots, a.half_life, a.prompt, windows)
        print(f"{rule:<12} " + " ".join(f"{f'{h:.1%} hit, {c:5.1f} copies':>22}" for h, c in got))
    print(f"{'oracle':<12} " + " ".join(f"{f'{h:.1%} hit':>22}" for h in oracle(ids, slots, a.prompt, windows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
