"""Sampling: greedy, temperature, top-k, top-p, min-p, repetition/presence/frequency penalties, log-probabilities,
seeded; values checked once with errors that say what to fix.

Order per token (vLLM's): penalties on the logits, then temperature, top-k, top-p, min-p. Greedy takes the argmax
of the penalized logits. Everything is float64 with the maximum subtracted before dividing by the temperature,
so no temperature gives NaN or inf probabilities. Log-probabilities are the model's own distribution (the raw
logits' log-softmax, before penalties, temperature and truncation; vLLM's default): comparable across settings,
and present for greedy requests too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

MIN_TEMPERATURE = 1e-5     # below it sampling is greedy (vLLM's threshold): so sharp a distribution is the argmax
MAX_LOGPROBS = 20          # alternatives per token at most (OpenAI's top_logprobs limit)
PENALTY_RANGE = 2.0        # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
REPETITION_RANGE = (0.01, 100.0)   # a float32 logit divided or multiplied by these stays finite in float64


class SamplingError(ValueError):
    """A sampling value out of range or of the wrong type; `param` names the SamplingParams field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _real(v) -> bool:
    """A finite real number, bool excepted (an integer past float's range, e.g. from JSON, is not finite)."""
    if not isinstance(v, Real) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _int(v) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def _check(name: str, ok: bool, value, want: str) -> None:
    if not ok:
        got = repr(value)
        raise SamplingError(name, f"{name} must be {want}, got {got if len(got) <= 60 else got[:57] + '...'}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0       # 0 = greedy (and anything below MIN_TEMPERATURE)
    top_k: int = 0                 # 0 = off
    top_p: float = 1.0             # 1 = off
    seed: int | None = None
    max_tokens: int = 128
    stop_at_eos: bool = True
    min_p: float = 0.0             # 0 = off: drop tokens less likely than min_p x the most likely one
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far (OpenAI's)
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated so far (OpenAI's)
    repetition_penalty: float = 1.0  # 1 = off: tokens of the prompt or the output get positive logits divided by
                                     # it, negative ones multiplied (CTRL's, as transformers and vLLM)
    logprobs: int | None = None    # None: none; k: the chosen token's log-probability and the k most likely
    stop: tuple[str, ...] = ()     # stop strings: the text ends before the first one (never part of it)
    stop_token_ids: tuple[int, ...] = ()  # more ids that end the generation like EOS (end-of-turn tokens; like
                                          # EOS, kept going past with stop_at_eos=False)

    def __post_init__(self):
        t, k, p, m = self.temperature, self.top_k, self.top_p, self.min_p
        _check("temperature", _real(t) and t >= 0, t, "a finite number >= 0 (0 = greedy)")
        _check("top_k", _int(k) and k >= 0, k, "an integer >= 0 (0 = off)")
        _check("top_p", _real(p) and 0 < p <= 1, p, "in (0, 1] (1 = off)")
        _check("min_p", _real(m) and 0 <= m <= 1, m, "in [0, 1] (0 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(name, _real(v) and abs(v) <= PENALTY_RANGE, v, f"in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}]")
        r, (lo, hi) = self.repetition_penalty, REPETITION_RANGE
        _check("repetition_penalty", _real(r) and lo <= r <= hi, r, f"in [{lo:g}, {hi:g}] (1 = off)")
        _check("max_tokens", _int(self.max_tokens) and self.max_tokens >= 0, self.max_tokens, "an integer >= 0")
        if self.seed is not None:
            _check("seed", _int(self.seed) and self.seed >= 0, self.seed, "a non-negative integer")
        if self.logprobs is not None:
            _check("logprobs", _int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS, self.logprobs,
                   f"an integer in [0, {MAX_LOGPROBS}]")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        _check("stop", isinstance(stop, Sequence) and all(isinstance(s, str) and s for s in stop), self.stop,
               "a string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        _check("stop_token_ids", isinstance(ids, Sequence) and all(_int(i) and i >= 0 for i in ids), ids,
               "a list of token ids")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the most likely alternatives, under the model's distribution."""
    logprob: float
    top: tuple[tuple[int, float], ...]      # (token id, log-probability), most likely first (ties: lower id)


def token_logprobs(logits: np.ndarray, token: int, k: int) -> TokenLogprobs:
    """Log-softmax of one row of logits (n_vocab,), in float64 with the maximum subtracted: the chosen token's value
    and the k largest. Only the normalizer is a vocabulary-sized pass; the k largest are found on the logits
    themselves (the log-softmax keeps their order and their ties), and only the k + 1 values asked for are formed."""
    m = float(logits.max())
    z = logits.astype(np.float64)
    z -= m
    lse = float(np.log(np.exp(z, out=z).sum()))
    lp = lambda i: (float(logits[i]) - m) - lse
    if k == 0:
        top = np.zeros(0, np.int64)
    else:                          # every token tied with the k-th largest, then the k first by (-logit, id)
        kth = np.partition(logits, -k)[-k] if k < logits.size else -np.inf
        cand = np.flatnonzero(logits >= kth)
        top = cand[np.lexsort((cand, -logits[cand]))][:k]
    return TokenLogprobs(lp(token), tuple((int(i), lp(i)) for i in top))


TOP_P_FIRST = 1024      # tokens ordered before the whole vocabulary is: a trained model's top_p set is far smaller
TOP_P_FLOOR = 1e-4      # first try the tokens within this factor of the most probable: one pass, no partition
TOP_P_FLOOR_MAX = 8192  # ... if they are this few
PICK_BLOCK = 512        # tokens a block of Sampler._pick's two-level cumulative mass


def _top_p_prefix(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Indices (ascending) of the smallest prefix of the tokens in descending probability (ties: lower index
    first) whose mass reaches top_p: token i of that order is kept while the mass before it is under top_p. The
    order is built for the 1024 most probable tokens first (a partition, then a stable sort of those); only when
    their mass is under top_p (a flat distribution) is the rest found by _top_p_by_bins, without sorting the
    vocabulary."""
    n, m = probs.size, TOP_P_FIRST
    if m < n:
        # every token at least a floor under the top: if their mass reaches top_p the set is among them, and they
        # are ordered as any candidate set of all tokens above a threshold is, so the result is the same as the
        # partition's below, without its pass over the vocabulary (1 of 3 ms of a peaked token on the 2-vCPU VM)
        cand = np.flatnonzero(probs >= probs.max() * TOP_P_FLOOR)
        if cand.size <= TOP_P_FLOOR_MAX:
            order = cand[np.argsort(-probs[cand], kind="stable")]
            mass = np.cumsum(probs[order])
            if mass[-1] >= top_p:
                return np.sort(order[mass - probs[order] < top_p])
    if m >= n:
        cand = np.arange(n)
    else:
        thr = np.partition(probs, n - m)[n - m]          # the m-th largest: every tie with it is a candidate
        cand = np.flatnonzero(probs >= thr)
    order = cand[np.argsort(-probs[cand], kind="stable")]
    mass = np.cumsum(probs[order])
    if m >= n or mass[-1] >= top_p:
        return np.sort(order[mass - probs[order] < top_p])
    return _top_p_by_bins(np.asarray(probs, np.float64), top_p)


def _top_p_by_bins(probs: np.ndarray, top_p: float) -> np.ndarray:
    """_top_p_prefix's set for a flat distribution (float64 probabilities): the tokens binned by the top 16 bits
    of their value (a non-negative float's bits order as its value), each bin's mass summed; every token of the
    bins above the one where the mass from the top reaches top_p is kept, and only that bin is sorted. A stable
    sort of a 248K vocabulary took 32-55 ms a token (bench_sampling.py's flat case), this ~2 ms."""
    key = probs.view(np.int64) >> 48                    # probabilities are >= 0: the sign bit is clear
    mass = np.bincount(key, weights=probs, minlength=1 << 16)
    above = np.cumsum(mass[::-1])[::-1]                 # above[b]: the mass of bins b and higher
    reach = np.flatnonzero(above >= top_p)
    b = int(reach[-1]) if reach.size else int(key.min())  # rounding short of top_p: every token is kept
    higher = above[b + 1] if b + 1 < above.size else 0.0
    inb = np.flatnonzero(key == b)
    ordb = inb[np.argsort(-probs[inb], kind="stable")]
    keep = key > b
    keep[ordb[higher + np.cumsum(probs[ordb]) - probs[ordb] < top_p]] = True
    return np.flatnonzero(keep)


class Sampler:
    """Draws token ids from logits; one per sequence, so a seed gives the same text every run. It counts the tokens
    it returned (and knows the prompt) for the penalties; `logprobs` is the last token's when params ask for them."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int] = ()):
        self.p = params
        self.rng = np.random.default_rng(params.seed)
        self.prompt = np.asarray(prompt, np.int64)
        self.counts: np.ndarray | None = None    # (n_vocab,) int64: times each token was generated; penalties only
        self.seen: np.ndarray | None = None      # (n_vocab,) bool: in the prompt or generated; penalties only
        self.logprobs: TokenLogprobs | None = None
        self._f64: np.ndarray | None = None       # (n_vocab,) work buffers of _draw, kept between calls
        self._f32: np.ndarray | None = None

    def __call__(self, logits: np.ndarray) -> int:
        if not np.all(np.isfinite(logits)):
            raise FloatingPointError("the model produced non-finite logits (NaN or inf): the weights or the "
                                     "backend are broken")
        z = self._penalize(logits.astype(np.float64)) if self.p.penalized else logits
        tok = int(np.argmax(z)) if self.p.greedy else self._draw(z)
        if self.p.penalized:
            self._count(tok)
        if self.p.logprobs is not None:
            self.logprobs = token_logprobs(logits, tok, self.p.logprobs)
        return tok

    def _penalize(self, z: np.ndarray) -> np.ndarray:
        """The penalties on z (a float64 copy of the logits, changed in place): only the tokens of the prompt or
        the output (the repetition penalty) and those generated (frequency, presence) change, so only they are
        touched, not the vocabulary (3 ms a token over 248K tokens when every entry was recomputed)."""
        if self.counts is None:
            self.counts = np.zeros(z.size, np.int64)
            self.seen = np.zeros(z.size, bool)
            self.seen[self.prompt] = True
            self._seen_ids = np.flatnonzero(self.seen)
            self._gen_ids = np.zeros(0, np.int64)
        p = self.p
        if p.repetition_penalty != 1:
            v = z[self._seen_ids]
            z[self._seen_ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            g = self._gen_ids
            c = self.counts[g]
            z[g] = z[g] - p.frequency_penalty * c - p.presence_penalty * (c > 0)
        return z

    def _count(self, tok: int) -> None:
        """A token returned: the penalties' counts and the ids they touch."""
        if not self.counts[tok]:
            self._gen_ids = np.append(self._gen_ids, tok)
        if not self.seen[tok]:
            self._seen_ids = np.append(self._seen_ids, tok)
        self.counts[tok] += 1
        self.seen[tok] = True

    def _draw(self, z: np.ndarray) -> int:
        """top_k, then top_p, then min_p, each renormalizing, then one draw. Only the tokens still in the running are
        carried from each filter to the next (`idx`, ascending), so a peaked distribution over a 248K vocabulary
        costs a partition and a short sort, not a sort of the vocabulary; the vocabulary-sized passes run in
        buffers kept between calls (a fresh array of a few MB a token is page faults)."""
        n = z.size
        if self._f64 is None or self._f64.size != n:
            self._f64, self._f32 = np.empty(n), np.empty(n, np.float32)
        # the maximum first: every value <= 0 and the top one exactly 0, so exp never overflows and the sum is >= 1
        zs = np.subtract(z, z.max(), out=self._f64, dtype=np.float64)   # float32 logits: no float64 copy first
        zs /= self.p.temperature
        idx = None                                           # None: every token
        if 0 < self.p.top_k < n:
            kth = np.partition(zs, -self.p.top_k)[-self.p.top_k]
            idx = np.flatnonzero(zs >= kth)                  # ties with the k-th all stay, as a full mask keeps
            zs = zs[idx]
        e = self._f32[:zs.size]
        with np.errstate(over="ignore"):                     # a tiny temperature: -inf in float32, exp 0
            np.copyto(e, zs, casting="same_kind")
        np.exp(e, out=e)                                     # float32 exp: twice as fast as float64's
        probs = zs
        np.copyto(probs, e)
        probs /= probs.sum()
        if self.p.top_p < 1:
            keep = _top_p_prefix(probs, self.p.top_p)        # the smallest set reaching top_p, ascending
            idx, probs = (keep if idx is None else idx[keep]), probs[keep]
            probs /= probs.sum()
        if self.p.min_p > 0:
            keep = np.flatnonzero(probs >= self.p.min_p * probs.max())
            idx, probs = (keep if idx is None else idx[keep]), probs[keep]
            probs /= probs.sum()
        j = self._pick(probs)
        return j if idx is None else int(idx[j])

    def _pick(self, probs: np.ndarray) -> int:
        """An index drawn with these probabilities (they sum to 1): the first whose cumulative mass passes a
        uniform draw, as Generator.choice does, without its checks over the whole vocabulary. Over a long vector
        the cumulative mass is taken in two levels, blocks of PICK_BLOCK tokens and then the one block the draw
        falls in: a vocabulary-sized cumulative sum was most of a plain-temperature token (0.7 of 1.15 ms over
        248K tokens on the development VM), a sum per block is a tenth of it."""
        u = self.rng.random()
        if probs.size <= 4 * PICK_BLOCK:
            cdf = np.cumsum(probs)
            return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), probs.size - 1)
        cb = np.cumsum(np.add.reduceat(probs, np.arange(0, probs.size, PICK_BLOCK)))
        u *= cb[-1]
        b = min(int(np.searchsorted(cb, u, side="right")), cb.size - 1)
        seg = probs[b * PICK_BLOCK:(b + 1) * PICK_BLOCK]
        j = int(np.searchsorted(np.cumsum(seg), u - (cb[b - 1] if b else 0.0), side="right"))
        if j < seg.size:
            return b * PICK_BLOCK + j
        # rounding put the draw past the block's own sum: the last token with any probability, there or before
        nz = np.flatnonzero(probs[:(b + 1) * PICK_BLOCK])
        return int(nz[-1])
