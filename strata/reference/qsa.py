"""QSA: gated attention that, past the budget, attends only to the blocks an indexer selects, plus the tail.

Per query position t: complete blocks are tokens [r*b, r*b + r-1] with r*b + r-1 <= t (r = compress ratio).
A block's key is RoPE(RMSNorm(mean of its r raw indexer keys), at r*b); it never changes once complete, so it
is cached when the block completes. The indexer scores blocks by sum_h relu(iq_h . key_b) / sqrt(Di) and keeps
the top budget/r of them; the incomplete tail is always attended.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strata.config import ModelConfig
from strata.reference.common import F32, rms_norm, rope, sigmoid, softmax


@dataclass
class QsaState:
    k: list = field(default_factory=list)          # per cell (Hkv, D): normed, rotated keys
    v: list = field(default_factory=list)          # per cell (Hkv, D)
    idx_raw: list = field(default_factory=list)    # per cell (Di,): raw indexer keys, unnormed, unrotated
    idx_blocks: list = field(default_factory=list)  # per complete block (Di,): pooled, normed, rotated keys


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
        pooled = np.mean(np.stack(st.idx_raw[b * ratio:(b + 1) * ratio]), axis=0, dtype=F32)
        st.idx_blocks.append(rope(rms_norm(pooled, w.indexer_k_norm, eps)[None, :], b * ratio, inv_freq)[0])

    n_blocks = (pos + 1) // ratio
    topk = cfg.block_topk(il)
    if n_blocks > topk:
        iq = rope(rms_norm((w.indexer_q_proj @ x).reshape(Hi, Di), w.indexer_q_norm, eps), pos, inv_freq)
        scores = np.maximum(iq @ np.stack(st.idx_blocks).T, 0).sum(axis=0, dtype=F32) / F32(np.sqrt(Di))
        blocks = np.sort(select_blocks(scores, topk))
    else:
        scores, blocks = None, np.arange(n_blocks)
    cells = np.concatenate([(blocks[:, None] * ratio + np.arange(ratio)[None, :]).reshape(-1),
                            np.arange(n_blocks * ratio, pos + 1)])

    K = np.stack([st.k[c] for c in cells])                    # (n_cells, Hkv, D)
    V = np.stack([st.v[c] for c in cells])
    group = H // Hkv
    att = np.empty((H, D), F32)
    for h in range(H):
        kvh = h // group                                       # GQA: consecutive query heads share a kv head
        p = softmax(K[:, kvh] @ q[h] / F32(np.sqrt(D)))
        att[h] = p @ V[:, kvh]
    out = w.attn_output @ (att.reshape(-1) * sigmoid(gate))
    return out, {"cells": cells, "scores": scores}
