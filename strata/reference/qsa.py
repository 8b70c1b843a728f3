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
from numba import njit

from strata.config import ModelConfig
from strata.reference.common import F32, rms_norm, rope, sigmoid


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


def _cells(cfg: ModelConfig, il: int, segs, t: np.ndarray, iq: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The cells each of the step's queries at positions t (T,) attends, each in its own sequence (segs as in
    qsa_chunk): (cells (T, C) int64, valid (T, C) bool). One select_blocks call for every query past the budget."""
    r, topk = cfg.compress_ratios[il], cfg.block_topk(il)
    C = cfg.idx_budget + r - 1
    slot = np.arange(C)
    valid = slot[None, :] <= t[:, None]                      # below the budget: every cell 0..t
    cells = np.where(valid, slot[None, :], 0)
    nb = (t + 1) // r                                        # complete blocks at each query
    sel = np.flatnonzero(nb > topk)
    if sel.size:
        # scores (m, B) of each selecting query against its own sequence's blocks; a block not complete yet at
        # that query (or past its sequence's blocks) scores -1, below every relu score
        scores = np.full((sel.size, int(nb[sel].max())), -1.0, F32)
        cut = np.searchsorted(sel, [a for _, a, _ in segs] + [len(t)])
        for (st, _, _), i0, i1 in zip(segs, cut[:-1], cut[1:]):
            if i1 > i0:
                blocks = st.idx_blocks.view()[:int(nb[sel[i1 - 1]])]     # (B, Di): its last query sees the most
                scores[i0:i1, :len(blocks)] = block_scores(cfg, iq[sel[i0:i1]], blocks)
        scores[np.arange(scores.shape[1])[None, :] >= nb[sel, None]] = -1.0
        chosen = select_blocks(scores, topk)                                  # (m, topk)
        c_blk = (chosen[:, :, None] * r + np.arange(r)).reshape(len(sel), topk * r)
        tail = np.arange(r - 1)
        c_tail = nb[sel, None] * r + tail                                     # (m, r-1)
        in_tail = tail < (t[sel, None] + 1 - nb[sel, None] * r)
        cells[sel] = np.concatenate([c_blk, np.where(in_tail, c_tail, 0)], 1)
        valid[sel] = np.concatenate([np.ones_like(c_blk, bool), in_tail], 1)
    return cells, valid


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def attend(K, V, q, cells, valid, out):
    """out[i] = softmax(q[i] . K[c] / sqrt(D)) V[c] over the valid cells c = cells[i, j], per head, in float64 (the
    sums' order is then immaterial at float32); GQA: query head h reads kv head h // (H / Hkv). K, V (cells, Hkv, D);
    q, out (n, H, D); cells, valid (n, C). A row's arithmetic depends on its own cells only, never on n."""
    n, H, D = q.shape
    G = H // K.shape[1]
    C = cells.shape[1]
    sq = np.sqrt(np.float64(D))
    s = np.empty(C, np.float64)
    acc = np.empty(D, np.float64)
    for i in range(n):
        for h in range(H):
            g = h // G
            top = -np.inf
            for j in range(C):
                if valid[i, j]:
                    c = cells[i, j]
                    dot = 0.0
                    for d in range(D):
                        dot += np.float64(q[i, h, d]) * np.float64(K[c, g, d])
                    s[j] = dot / sq
                    top = max(top, s[j])
            tot = 0.0
            for j in range(C):
                if valid[i, j]:
                    s[j] = np.exp(s[j] - top)
                    tot += s[j]
            acc[:] = 0.0
            for j in range(C):
                if valid[i, j]:
                    c, p = cells[i, j], s[j] / tot
                    for d in range(D):
                        acc[d] += p * np.float64(V[c, g, d])
            for d in range(D):
                out[i, h, d] = np.float32(acc[d])


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
    cells, valid = _cells(cfg, il, segs, pos, iq)
    for st, a, n in segs:
        attend(st.k.view(), st.v.view(), q[a:a + n], cells[a:a + n], valid[a:a + n], att[a:a + n])
    return w.attn_output @ (att.reshape(T, H * D) * sigmoid(gate))
