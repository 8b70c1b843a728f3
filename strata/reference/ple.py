"""PLE: hashed n-gram embeddings gathered from a global table and gated into every residual stream (layer 1).

Per token: 16 table rows (8 heads hash the bigram, 8 the trigram), concatenated to e; a key per stream and one
value come from e; each stream's normalized activation gates the value; a dilated causal depthwise conv over
the normalized gated values adds local context. The hash and the row reads are host work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.config import ModelConfig
from strata.reference.common import F32, rms_norm, sigmoid, silu

_MASK64 = (1 << 64) - 1


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


@dataclass
class PleState:
    hist: np.ndarray           # (ple_hist, hc*E): previous normalized conv inputs, oldest first: device state

    @classmethod
    def start(cls, cfg: ModelConfig) -> "PleState":
        return cls(np.zeros((cfg.ple_hist, cfg.hc_dim), F32))


def ple_rows(cfg: ModelConfig, token: int, prev: tuple[int, int]) -> np.ndarray:
    """Table rows (ple_heads,) for `token` with predecessors prev = (t1, t2); 64-bit unsigned arithmetic."""
    m = cfg.ple_multipliers
    mix = (token * m[0]) & _MASK64
    rows = []
    hp = cfg.ple_heads_per_ngram
    for n in range(2, cfg.ple_ngram + 1):          # n-gram order: 2 (bigram) .. ngram_size
        mix = mix ^ ((prev[n - 2] * m[n - 1]) & _MASK64)
        for h in range((n - 2) * hp, (n - 1) * hp):
            rows.append(mix % cfg.ple_vocab_sizes[h] + cfg.ple_offsets[h])
    return np.array(rows, dtype=np.int64)


def ple_gather(w_table, rows: np.ndarray) -> np.ndarray:
    """The gathered vector e (ple_dim,): each head's row, dequantized, concatenated in head order."""
    return np.concatenate([w_table.row(int(r)) for r in rows]).astype(F32)


def ple_block(cfg: ModelConfig, w, st: PleState, R: np.ndarray, e: np.ndarray) -> np.ndarray:
    """R (hc, E) -> R + gated + silu(conv(norm(gated))); advances the conv history."""
    hc, E, eps = cfg.hc, cfg.n_embd, cfg.rms_eps
    key = rms_norm((w.ple_key @ e).reshape(hc, E), w.ple_norm_key, eps)
    value = w.ple_value @ e                                          # (E,)
    q = rms_norm(R, w.ple_norm_query, eps)
    a = np.sum(key * q, axis=1, dtype=F32) / F32(np.sqrt(E))         # (hc,)
    gate = sigmoid(np.sign(a) * np.sqrt(np.maximum(np.abs(a), F32(1e-6))))
    gated = gate[:, None] * value[None, :]                           # (hc, E)
    gn = rms_norm(gated, w.ple_norm_conv, eps).reshape(-1)           # (hc*E,)
    # dilated causal conv: taps at t - (K-1-j) * ngram for j = 0..K-1
    dil, K = cfg.ple_ngram, cfg.ple_conv
    taps = [st.hist[j * dil] for j in range(K - 1)] + [gn]
    conv = np.einsum("kc,ck->c", np.stack(taps), w.ple_conv1d, dtype=F32)
    st.hist = np.concatenate([st.hist[1:], gn[None, :]], axis=0)
    return (R + gated + silu(conv).reshape(hc, E)).astype(F32)
