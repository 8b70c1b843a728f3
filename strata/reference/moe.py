"""MoE: softmax router with renormalized top-k, routed SwiGLU experts, a sigmoid-gated shared expert.

The split matters to the scheduler: `route` ends the `pre` stage (the doorbell), `expert_ffn` is what the
CPU pool or a VRAM-resident expert computes between the stages, `combine` starts `post`.
T = tokens in the step, k = experts per token, E = hidden size.
"""

from __future__ import annotations

import numpy as np

from strata.config import ModelConfig
from strata.reference.common import F32, sigmoid, silu, softmax


def route(cfg: ModelConfig, w, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (T, E) -> expert ids (T, k) int32 in descending probability (ties: lower id), weights (T, k) summing to 1."""
    p = softmax(w.ffn_gate_inp @ x)                                      # (T, n_expert)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :cfg.n_expert_used]
    sel = np.take_along_axis(p, ids, axis=1)
    wts = sel / sel.sum(axis=1, keepdims=True, dtype=F32)
    return ids.astype(np.int32), wts.astype(F32)


def group_by_expert(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids (T, k) -> (experts (U,) ascending, offsets (U+1,), pairs (P = T*k,)): expert experts[u] serves the flat
    (row * k + j) pairs[offsets[u]:offsets[u+1]], in row order."""
    flat = ids.reshape(-1)
    pairs = np.argsort(flat, kind="stable")
    experts, starts = np.unique(flat[pairs], return_index=True)
    return experts.astype(np.int32), np.append(starts, flat.size).astype(np.int64), pairs.astype(np.int64)


def expert_ffn(gate, up, down, x: np.ndarray) -> np.ndarray:
    """One SwiGLU expert on rows x (n, E) (or one row (E,)): down @ (silu(gate @ x) * (up @ x))."""
    return down @ (silu(gate @ x) * (up @ x)).astype(F32)


def shared_expert(w, x: np.ndarray) -> np.ndarray:
    """x (T, E) -> (T, E); the gate's dot is a row-wise sum, so a row's value does not depend on T."""
    y = expert_ffn(w.ffn_gate_shexp, w.ffn_up_shexp, w.ffn_down_shexp, x)
    return y * sigmoid(np.sum(x * w.ffn_gate_inp_shexp, axis=1, keepdims=True, dtype=F32))


def combine(weights: np.ndarray, parts: np.ndarray, shared: np.ndarray) -> np.ndarray:
    """sum_j w_j * parts_j + shared per row, j in route order; weights (T, k), parts (T, k, E) must be THIS layer's
    experts for THIS layer's weights."""
    out = weights[:, 0, None] * parts[:, 0]
    for j in range(1, weights.shape[1]):
        out += weights[:, j, None] * parts[:, j]
    return (out + shared).astype(F32)
