"""QSA: gated attention that, past the budget, attends only to the blocks an indexer selects, plus the tail.

Per query position t: complete blocks are tokens [r*b, r*b + r-1] with r*b + r-1 <= t (r = compress ratio).
A block's key is RoPE(RMSNorm(mean of its r raw indexer keys), at r*b); it never changes once complete, so it
is cached when the block completes. The indexer scores blocks by sum_h relu(iq_h . key_b) / sqrt(Di) and keeps
the top budget/r of them; the incomplete tail is always attended.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.config import ModelConfig
from strata.reference.common import F32, rms_norm, rope, sigmoid, softmax


class _Rows:
    """An append-only array of rows that grows by doubling, so a step costs O(1) amortized, not a list copy."""

    def __init__(self, row_shape: tuple[int, ...]):
        self.a = np.empty((16, *row_shape), F32)
        self.n = 0

    def append(self, row: np.ndarray) -> None:
        if self.n == len(self.a):
            self.a = np.concatenate([self.a, np.empty_like(self.a)])
        self.a[self.n] = row
        self.n += 1

    def view(self) -> np.ndarray:
        return self.a[:self.n]


@dataclass
class QsaState:
    k: _Rows                   # (cells, Hkv, D): normed, rotated keys
    v: _Rows                   # (cells, Hkv, D)
    idx_raw: _Rows             # (cells, Di): raw indexer keys, unnormed, unrotated
    idx_blocks: _Rows          # (complete blocks, Di): pooled, normed, rotated keys

    @classmethod
    def empty(cls, cfg: ModelConfig) -> "QsaState":
        kv = (cfg.n_head_kv, cfg.head_dim)
        return cls(_Rows(kv), _Rows(kv), _Rows((cfg.idx_dim,)), _Rows((cfg.idx_dim,)))


def select_blocks(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k highest scores, in descending score order; ties go to the lower block index."""
    order = np.argsort(-scores, kind="stable")
    return order[:k]


def qsa_step(cfg: ModelConfig, il: int, w, st: QsaState, x: np.ndarray, pos: int,
             inv_freq: np.ndarray) -> tuple[np.ndarray, dict]:
    """x (E,) at position `pos` (= number of cells already cached) -> out (E,), debug info."""
    H, Hkv, D, Hi, Di = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.idx_heads, cfg.idx_dim
    ratio = cfg.compress_ratios[il]
    eps = cfg.rms_eps

    qg = (w.attn_q @ x).reshape(H, 2 * D)                     # per head [q | gate]
    q = rope(rms_norm(qg[:, :D], w.attn_q_norm, eps), pos, inv_freq)
    gate = qg[:, D:].reshape(-1)
    k = rope(rms_norm((w.attn_k @ x).reshape(Hkv, D), w.attn_k_norm, eps), pos, inv_freq)
    v = (w.attn_v @ x).reshape(Hkv, D)
    st.k.append(k)
    st.v.append(v)

    st.idx_raw.append(w.indexer_k_proj @ x)
    if (pos + 1) % ratio == 0:
        b = pos // ratio
        pooled = np.mean(st.idx_raw.view()[b * ratio:(b + 1) * ratio], axis=0, dtype=F32)
        st.idx_blocks.append(rope(rms_norm(pooled, w.indexer_k_norm, eps)[None, :], b * ratio, inv_freq)[0])

    n_blocks = (pos + 1) // ratio
    topk = cfg.block_topk(il)
    if n_blocks > topk:
        iq = rope(rms_norm((w.indexer_q_proj @ x).reshape(Hi, Di), w.indexer_q_norm, eps), pos, inv_freq)
        scores = np.maximum(iq @ st.idx_blocks.view().T, 0).sum(axis=0, dtype=F32) / F32(np.sqrt(Di))
        blocks = np.sort(select_blocks(scores, topk))
    else:
        scores, blocks = None, np.arange(n_blocks)
    cells = np.concatenate([(blocks[:, None] * ratio + np.arange(ratio)[None, :]).reshape(-1),
                            np.arange(n_blocks * ratio, pos + 1)])

    K, V = st.k.view()[cells], st.v.view()[cells]              # (n_cells, Hkv, D)
    group = H // Hkv
    qh = q.reshape(Hkv, group, D)                              # GQA: consecutive query heads share a kv head
    p = softmax(np.einsum("kgd,ckd->kgc", qh, K, dtype=F32) / F32(np.sqrt(D)))
    att = np.einsum("kgc,ckd->kgd", p, V, dtype=F32).reshape(H, D)
    out = w.attn_output @ (att.reshape(-1) * sigmoid(gate))
    return out, {"cells": cells, "scores": scores}
