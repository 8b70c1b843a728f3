"""Prefix reuse: a request whose prompt starts with what an earlier one was fed resumes from that sequence's
snapshot, with exactly the logits recomputing gives; the snapshots stay within their budget."""

from __future__ import annotations

import numpy as np
import pytest

from strata.engine import Engine, HostConfig
from strata.host.backend import CpuBackend
from strata.host.trace import load
from strata.model.loader import load_model
from strata.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=4, stop_at_eos=False)


class Recording(CpuBackend):
    """Keeps every logits block the head produced."""

    def __init__(self, model):
        super().__init__(model)
        self.seen: list[np.ndarray] = []

    def poll_logits(self):
        out = super().poll_logits()
        if out is not None:
            self.seen.append(out.copy())
        return out


async def _run(model, turns, budget: int, trace=None):
    """Each prompt in turn (the next may extend the previous turn's output: a callable of it), greedy."""
    be = Recording(model)
    out, prompts = [], []
    async with Engine(model, backend=be, host=HostConfig(prefix_cache_bytes=budget, step_tokens=16),
                      trace=trace) as e:
        for t in turns:
            prompt = t(prompts[-1], out[-1]) if callable(t) else t
            prompts.append(prompt)
            be.seen.clear()
            toks = [c.token async for c in e.generate(prompt, GREEDY) if c.token is not None]
            out.append((toks, np.concatenate(be.seen)))
        stats = (e.scheduler.prefixes.hits, e.scheduler.prefixes.tokens_reused) if budget else (0, 0)
    return out, stats


@pytest.mark.asyncio
async def test_resumed_logits_equal_recomputed(tiny_gguf, tmp_path):
    """A: a 40-token prompt (past the QSA budget, EOS inside). B: A's prompt and 7 more tokens: resumes at A's
    prompt. C: B's prompt, B's first three generated tokens and 5 more, the next turn of a chat: resumes at
    everything B was fed. Every logits row of B and C, and their tokens, equal a run with no snapshots."""
    model = load_model(tiny_gguf)
    rng = np.random.default_rng(4)
    a = rng.integers(0, 512, 40).tolist()
    a[17] = 500
    turns = [a, a + rng.integers(0, 512, 7).tolist(),
             lambda prev, out: prev + out[0][:3] + [9, 8, 7, 6, 5]]
    path = tmp_path / "t.jsonl"
    got, (hits, reused) = await _run(model, turns, 1 << 30, trace=path)
    want, _ = await _run(model, turns, 0)
    for (gt, gl), (wt, wl) in zip(got, want):
        assert gt == wt and np.array_equal(gl, wl)
    assert hits == 2 and reused == 40 + (47 + 3)
    recs = load(str(path), "prefix")
    assert [(r["reused"], r["prompt"]) for r in recs] == [(40, 47), (50, 55)]


@pytest.mark.asyncio
async def test_snapshots_stay_in_budget(tiny_gguf):
    model = load_model(tiny_gguf)
    async with Engine(model, host=HostConfig(prefix_cache_bytes=400_000)) as e:
        for i in range(6):
            prompt = np.random.default_rng(i).integers(0, 512, 30 + 10 * i).tolist()
            async for _ in e.generate(prompt, GREEDY):
                pass
        p = e.scheduler.prefixes
        assert 0 < len(p) < 12 and p.bytes <= p.budget
        await e.scheduler.score(prompt + [1, 2])              # scoring needs every position: no reuse
        assert p.hits == 0
