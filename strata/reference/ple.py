"""PLE: hashed n-gram embeddings gathered from a global table and gated into every residual stream (layer 1).

Per token: 16 table rows (8 heads hash the bigram, 8 the trigram), concatenated to e; a key per stream and one
value come from e; each stream's normalized activation gates the value; a dilated causal depthwise conv over
the normalized gated values adds local context. The hash and the row reads are host work, vectorized over a
chunk's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.config import ModelConfig
from strata.reference.common import F32, rms_norm, sigmoid, silu, table_rows


@dataclass
class NgramWindow:
    """The previous two tokens as the hash sees them (EOS where cut): host state, owned by whoever hashes."""
    prev: tuple[int, int]      # (t1, t2)

    @classmethod
    def start(cls, cfg: ModelConfig) -> "NgramWindow":
        return cls((cfg.ple_eos, cfg.ple_eos))

    def advance(self, cfg: ModelConfig, token: int) -> None:
        """After `token`: it becomes t1; an EOS cuts the n-gram so nothing before it is seen (t2 = EOS)."""
        t1 = self.prev[0]
        self.prev = (token, cfg.ple_eos if token == cfg.ple_eos else t1)

    def predecessors(self, cfg: ModelConfig, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(t1, t2) (n,) each of a chunk's tokens sees, starting from this window (which is not advanced)."""
        eos = cfg.ple_eos
        t1 = np.concatenate([[self.prev[0]], tokens[:-1]]).astype(np.int64)
        t2 = np.concatenate([[self.prev[1]], np.where(tokens[:-1] == eos, eos, t1[:-1])]).astype(np.int64)
        return t1, t2

    def advance_all(self, cfg: ModelConfig, tokens) -> None:
        """advance() by every token of a chunk, in order."""
        if len(tokens) == 1:
            self.advance(cfg, int(tokens[0]))
        elif len(tokens):
            t1, _ = self.predecessors(cfg, np.asarray(tokens, np.int64))
            last = int(tokens[-1])
            self.prev = (last, cfg.ple_eos if last == cfg.ple_eos else int(t1[-1]))


@dataclass
class PleState:
    hist: np.ndarray           # (ple_hist, hc*E): previous normalized conv inputs, oldest first: device state

    @classmethod
    def start(cls, cfg: ModelConfig) -> "PleState":
        return cls(np.zeros((cfg.ple_hist, cfg.hc_dim), F32))


U64 = (1 << 64) - 1


def ple_rows(cfg: ModelConfig, tokens, window: NgramWindow) -> np.ndarray:
    """Table rows (n, ple_heads) of a chunk's tokens (n,) whose first token follows `window`; uint64 arithmetic
    wraps like the reference's 64-bit unsigned hash."""
    t0 = np.asarray(tokens, np.int64).reshape(-1)
    if t0.size == 1:
        return _ple_rows_one(cfg, int(t0[0]), window)
    prev = window.predecessors(cfg, t0)
    m = np.array(cfg.ple_multipliers, np.uint64)
    sizes, offsets = np.array(cfg.ple_vocab_sizes, np.uint64), np.array(cfg.ple_offsets, np.uint64)
    hp = cfg.ple_heads_per_ngram
    mix = t0.astype(np.uint64) * m[0]
    out = np.empty((t0.size, cfg.ple_heads), np.int64)
    for order in range(2, cfg.ple_ngram + 1):                 # n-gram order: 2 (bigram) .. ngram_size
        mix = mix ^ (prev[order - 2].astype(np.uint64) * m[order - 1])
        heads = slice((order - 2) * hp, (order - 1) * hp)
        out[:, heads] = (mix[:, None] % sizes[heads] + offsets[heads]).astype(np.int64)
    return out


def _ple_rows_one(cfg: ModelConfig, token: int, window: NgramWindow) -> np.ndarray:
    """ple_rows of one token (a decode step's) in Python integers: the same hash, without the dozen small numpy
    calls that cost ~60 us a token on the loop's thread."""
    m, sizes, offsets, hp = cfg.ple_multipliers, cfg.ple_vocab_sizes, cfg.ple_offsets, cfg.ple_heads_per_ngram
    mix = (token * m[0]) & U64
    out = []
    for order in range(2, cfg.ple_ngram + 1):
        mix ^= (window.prev[order - 2] * m[order - 1]) & U64
        out += [mix % sizes[h] + offsets[h] for h in range((order - 2) * hp, (order - 1) * hp)]
    return np.array([out], np.int64)


def ple_gather(w_table, rows: np.ndarray) -> np.ndarray:
    """The gathered vectors e (n, ple_dim) of rows (n, heads): each head's row, dequantized, in head order."""
    n, heads = rows.shape
    uniq, inv = np.unique(rows.reshape(-1), return_inverse=True)
    vals = table_rows(w_table, uniq)                                         # (U, row)
    return vals[inv].reshape(n, heads * vals.shape[1])


def ple_block(cfg: ModelConfig, w, segs, R: np.ndarray, e: np.ndarray) -> np.ndarray:
    """R (T, hc, E) -> R + gated + silu(conv(norm(gated))); segs [(PleState, first row, rows)] advance their conv
    histories."""
    T, hc, E = R.shape
    eps = cfg.rms_eps
    key = rms_norm((w.ple_key @ e).reshape(T, hc, E), w.ple_norm_key, eps)
    value = w.ple_value @ e                                          # (T, E)
    q = rms_norm(R, w.ple_norm_query, eps)
    a = np.sum(key * q, axis=2, dtype=F32) / F32(np.sqrt(E))         # (T, hc)
    gate = sigmoid(np.sign(a) * np.sqrt(np.maximum(np.abs(a), F32(1e-6))))
    gated = gate[:, :, None] * value[:, None, :]                     # (T, hc, E)
    gn = rms_norm(gated, w.ple_norm_conv, eps).reshape(T, hc * E)
    # dilated causal conv: taps at t - (K-1-j) * ngram for j = 0..K-1, over [history | this chunk]
    dil, K = cfg.ple_ngram, cfg.ple_conv
    conv = np.empty_like(gn)
    for st, a0, n in segs:
        seq = np.concatenate([st.hist, gn[a0:a0 + n]], axis=0)       # (ple_hist + n, hc*E)
        acc = seq[0:n] * w.ple_conv1d[:, 0]
        for j in range(1, K):
            acc += seq[j * dil:j * dil + n] * w.ple_conv1d[:, j]
        conv[a0:a0 + n] = acc
        st.hist = seq[n:].copy()
    return (R + gated + silu(conv).reshape(T, hc, E)).astype(F32)
