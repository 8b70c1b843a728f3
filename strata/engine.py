"""Engine: open a model file and run it. Teacher-forced logits here; generation goes through strata.host."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np

from strata.model.loader import Model, load_model
from strata.reference.model import RefModel, StageDump
from strata.tokenizer import Tokenizer


class Engine:
    """One loaded model: weights mapped from the GGUF, its tokenizer, and the reference stages over them."""

    def __init__(self, model: Model, exact: bool = False):
        self.model = model
        self.cfg = model.cfg
        self.tokenizer = Tokenizer.from_metadata(model.metadata)
        self.ref = RefModel(model.weights)
        self.exact = exact

    @classmethod
    def open_sync(cls, path: str | os.PathLike | None = None, *, exact: bool = False) -> "Engine":
        if path is None:
            from strata.default_model import default_model_path
            path = default_model_path()
        return cls(load_model(path, exact=exact), exact=exact)

    def check_tokens(self, tokens: Sequence[int]) -> list[int]:
        out = []
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < self.cfg.n_vocab:
                raise ValueError(f"token #{i} = {t!r} is not a token id in [0, {self.cfg.n_vocab})")
            out.append(int(t))
        if not out:
            raise ValueError("no tokens: give at least one")
        return out

    def logits(self, tokens: Sequence[int], dump: StageDump | None = None,
               progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """Teacher-forced logits, float32 (n_tokens, n_vocab): position i sees tokens[:i + 1]."""
        tokens = self.check_tokens(tokens)
        st = self.ref.new_state(dump)
        out = np.empty((len(tokens), self.cfg.n_vocab), np.float32)
        for i, t in enumerate(tokens):
            out[i] = self.ref.step(st, t)
            if progress:
                progress(i + 1, len(tokens))
        return out

    def generate_sync(self, prompt: str | Sequence[int], params, progress=None):
        """Yield (text delta, token id) for each generated token; stops at EOS (if asked) or max_tokens."""
        from strata.sampling import Sampler
        tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        tokens = self.check_tokens(tokens)
        st = self.ref.new_state()
        sampler, text = Sampler(params), self.tokenizer.stream()
        for i, t in enumerate(tokens):
            logits = self.ref.step(st, t)
            if progress:
                progress(i + 1, len(tokens))
        for _ in range(params.max_tokens):
            tok = sampler(logits)
            if params.stop_at_eos and tok == self.tokenizer.eos_id:
                break
            yield text.push(tok), tok
            logits = self.ref.step(st, tok)
        tail = text.flush()
        if tail:
            yield tail, None
