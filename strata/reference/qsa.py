"""QSA: gated attention that, past the budget, attends only to the blocks an indexer selects, plus the tail.

Per query position t: complete blocks are tokens [r*b, r*b + r-1] with r*b + r-1 <= t (r = compress ratio).
A block's key is RoPE(RMSNorm(mean of its r raw indexer keys), at r*b); it never changes once complete, so it
is cached when the block completes. The indexer scores blocks by sum_h relu(iq_h . key_b) / sqrt(Di) and keeps
the top budget/r of them (ties: the lower block index); the incomplete tail is always attended.

A chunk of one sequence appends all its keys first, then each of its queries attends to its own cells only
(the causal limit is part of each query's cell set), so a chunk gives what its tokens one at a time give.
Every query attends over C = budget + r - 1 cell slots, the unused ones masked: the cell count never exceeds
that (below the budget all cells 0..t, past it budget/r blocks plus at most r-1 tail cells), so a row's
arithmetic has one shape whatever else is in the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.config import ModelConfig
from strata.reference.common import F32, rms_norm, rope, sigmoid, softmax

GATHER_BYTES = 64 << 20        # gathered K and V of the queries attended at once


class _Rows:
    """An append-only array of rows that grows by doubling, so a step costs O(1) amortized, not a list copy."""

    def __init__(self, row_shape: tuple[int, ...]):
        self.a = np.empty((16, *row_shape), F32)
        self.n = 0

    def extend(self, rows: np.ndarray) -> None:
        need = self.n + len(rows)
        if need > len(self.a):
            grown = np.empty((max(need, 2 * len(self.a)), *self.a.shape[1:]), F32)
            grown[:self.n] = self.a[:self.n]
            self.a = grown
        self.a[self.n:need] = rows
        self.n = need

    def view(self) -> np.ndarray:
        return self.a[:self.n]

    def copy(self) -> "_Rows":
        """The rows so far in an array of their own (room for no more: the next extend grows it)."""
        out = _Rows(self.a.shape[1:])
        out.a, out.n = self.a[:self.n].copy(), self.n
        return out


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
    """Per row of scores (n, blocks), the indices of the k highest, ascending; ties go to the lower block index."""
    return np.sort(np.argsort(-scores, axis=-1, kind="stable")[..., :k], axis=-1)


def block_scores(cfg: ModelConfig, iq: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """The indexer's scores (m, B) of queries iq (m, Hi, Di) against block keys (B, Di): sum_h relu(iq_h . key)."""
    return np.maximum(iq @ blocks.T, 0).sum(axis=1, dtype=F32) / F32(np.sqrt(cfg.idx_dim))


def _cells(cfg: ModelConfig, il: int, st: QsaState, t: np.ndarray, iq: np.ndarray | None) \
        -> tuple[np.ndarray, np.ndarray]:
    """The cells each query at positions t (n,) attends: (cells (n, C) int64, valid (n, C) bool)."""
    r, topk = cfg.compress_ratios[il], cfg.block_topk(il)
    C = cfg.idx_budget + r - 1
    slot = np.arange(C)
    valid = slot[None, :] <= t[:, None]                      # below the budget: every cell 0..t
    cells = np.where(valid, slot[None, :], 0)
    nb = (t + 1) // r                                        # complete blocks at each query
    sel = np.flatnonzero(nb > topk)
    if sel.size:
        blocks = st.idx_blocks.view()[:int(nb[sel].max())]   # (B, Di)
        scores = block_scores(cfg, iq[sel], blocks)          # (m, B)
        scores[np.arange(blocks.shape[0])[None, :] >= nb[sel, None]] = -1.0    # not complete yet at that query
        chosen = select_blocks(scores, topk)                                  # (m, topk)
        c_blk = (chosen[:, :, None] * r + np.arange(r)).reshape(len(sel), topk * r)
        tail = np.arange(r - 1)
        c_tail = nb[sel, None] * r + tail                                     # (m, r-1)
        cells[sel] = np.concatenate([c_blk, np.where(tail < (t[sel, None] + 1 - nb[sel, None] * r), c_tail, 0)], 1)
        valid[sel] = np.concatenate([np.ones_like(c_blk, bool), tail < (t[sel, None] + 1 - nb[sel, None] * r)], 1)
    return cells, valid


def _attend(cfg: ModelConfig, st: QsaState, q: np.ndarray, cells: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """q (n, H, D) over its cells -> (n, H, D); GQA: consecutive query heads share a kv head."""
    n, H, D = q.shape
    Hkv = cfg.n_head_kv
    Kc, Vc = st.k.view(), st.v.view()
    out = np.empty_like(q)
    per = max(1, GATHER_BYTES // (2 * cells.shape[1] * Hkv * D * 4))
    for a in range(0, n, per):
        b = min(n, a + per)
        K = Kc[cells[a:b]].transpose(0, 2, 3, 1)             # (m, Hkv, D, C)
        V = Vc[cells[a:b]].transpose(0, 2, 1, 3)             # (m, Hkv, C, D)
        qh = q[a:b].reshape(b - a, Hkv, H // Hkv, D)
        s = (qh @ K) / F32(np.sqrt(D))                       # (m, Hkv, G, C)
        s[~np.broadcast_to(valid[a:b, None, None, :], s.shape)] = -np.inf
        out[a:b] = (softmax(s) @ V).reshape(b - a, H, D)
    return out


def qsa_chunk(cfg: ModelConfig, il: int, w, segs, x: np.ndarray, pos: np.ndarray,
              inv_freq: np.ndarray) -> np.ndarray:
    """x (T, E) at positions pos (T,) -> out (T, E); segs [(QsaState, first row, rows)], each row's position the
    number of cells its sequence has cached before it."""
    T = x.shape[0]
    H, Hkv, D, Hi, Di = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.idx_heads, cfg.idx_dim
    r, eps = cfg.compress_ratios[il], cfg.rms_eps

    qg = (w.attn_q @ x).reshape(T, H, 2 * D)                 # per head [q | gate]
    q = rope(rms_norm(qg[:, :, :D], w.attn_q_norm, eps), pos, inv_freq)
    gate = qg[:, :, D:].reshape(T, H * D)
    k = rope(rms_norm((w.attn_k @ x).reshape(T, Hkv, D), w.attn_k_norm, eps), pos, inv_freq)
    v = (w.attn_v @ x).reshape(T, Hkv, D)
    ik = w.indexer_k_proj @ x                                # (T, Di)
    iq = None
    if np.any((pos + 1) // r > cfg.block_topk(il)):          # some query is past the budget: it selects
        iq = rope(rms_norm((w.indexer_q_proj @ x).reshape(T, Hi, Di), w.indexer_q_norm, eps), pos, inv_freq)

    att = np.empty((T, H, D), F32)
    for st, a, n in segs:
        st.k.extend(k[a:a + n])
        st.v.extend(v[a:a + n])
        st.idx_raw.extend(ik[a:a + n])
        b0, b1 = st.idx_blocks.n, st.idx_raw.n // r          # the blocks this chunk completed
        if b1 > b0:
            pooled = np.mean(st.idx_raw.view()[b0 * r:b1 * r].reshape(b1 - b0, r, Di), axis=1, dtype=F32)
            keys = rope(rms_norm(pooled, w.indexer_k_norm, eps)[:, None, :], np.arange(b0, b1) * r, inv_freq)
            st.idx_blocks.extend(keys[:, 0])
        cells, valid = _cells(cfg, il, st, pos[a:a + n], None if iq is None else iq[a:a + n])
        att[a:a + n] = _attend(cfg, st, q[a:a + n], cells, valid)
    return w.attn_output @ (att.reshape(T, H * D) * sigmoid(gate))
