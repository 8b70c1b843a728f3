"""Sampling: greedy, temperature, top-k, top-p, seeded; values checked once with errors that say what to fix."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0       # 0 = greedy
    top_k: int = 0                 # 0 = off
    top_p: float = 1.0             # 1 = off
    seed: int | None = None
    max_tokens: int = 128
    stop_at_eos: bool = True

    def __post_init__(self):
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not np.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not isinstance(self.max_tokens, (int, np.integer)) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, (int, np.integer)) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")


class Sampler:
    """Draws token ids from logits; one per sequence, so a seed gives the same text every run."""

    def __init__(self, params: SamplingParams):
        self.p = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        if not np.all(np.isfinite(logits)):
            raise FloatingPointError("the model produced non-finite logits (NaN or inf): the weights or the "
                                     "backend are broken")
        if self.p.temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.p.temperature
        if 0 < self.p.top_k < z.size:
            kth = np.partition(z, -self.p.top_k)[-self.p.top_k]
            z = np.where(z >= kth, z, -np.inf)
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        if self.p.top_p < 1:
            order = np.argsort(-probs, kind="stable")
            keep = np.cumsum(probs[order]) - probs[order] < self.p.top_p   # the smallest set reaching top_p
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[keep]] = True
            probs = np.where(mask, probs, 0)
            probs /= probs.sum()
        return int(self.rng.choice(probs.size, p=probs))
