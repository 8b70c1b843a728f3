"""MoE: softmax router with renormalized top-k, routed SwiGLU experts, a sigmoid-gated shared expert.

The split matters to the scheduler: `route` ends the `pre` stage (the doorbell), `expert_ffn` is what the
CPU pool or a VRAM-resident expert computes between the stages, `combine` starts `post`.
T = tokens in the step, k = experts per token, E = hidden size.
"""

from __future__ import annotations

import numpy as np

from strata.config import ModelConfig
from strata.quant.experts import batched, expert_batch, group_by_expert   # noqa: F401 (re-exported)
from strata.reference.common import F32, sigmoid, silu, softmax


def route(cfg: ModelConfig, w, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (T, E) -> expert ids (T, k) int32 in descending probability (ties: lower id), weights (T, k) summing to 1."""
    p = softmax(w.ffn_gate_inp @ x)                                      # (T, n_expert)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :cfg.n_expert_used]
    sel = np.take_along_axis(p, ids, axis=1)
    wts = sel / sel.sum(axis=1, keepdims=True, dtype=F32)
    return ids.astype(np.int32), wts.astype(F32)


def expert_ffn(gate, up, down, x: np.ndarray) -> np.ndarray:
    """One SwiGLU expert on rows x (n, E) (or one row (E,)): down @ (silu(gate @ x) * (up @ x))."""
    return down @ (silu(gate @ x) * (up @ x)).astype(F32)


def routed_experts(w, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """x (T, E), ids (T, k) -> the routed experts' outputs (T, k, E) in the order of ids, each distinct expert once
    over all its rows: for the quantized types one compiled batch over the stacked tensors (strata.quant.experts),
    else expert_ffn expert by expert. Either way bit for bit expert_ffn on each row alone."""
    T, k = ids.shape
    gate, up, down = ((w.ffn_gate_up_exps, w.ffn_gate_up_exps, w.ffn_down_exps) if w.ffn_gate_up_exps is not None
                      else (w.ffn_gate_exps, w.ffn_up_exps, w.ffn_down_exps))
    if gate.qtype == up.qtype and batched(gate.qtype, down.qtype):
        for m in {id(m): m for m in (gate, up, down)}.values():
            m._check()                                   # the mapped file is unchanged: its rows are read below
        stack = [m.raw.reshape(m.n_mat, m.n_out, -1) for m in (gate, up, down)]   # (n_expert, rows, row_bytes)
        if w.ffn_gate_up_exps is not None:               # the fused tensor's halves
            half = gate.n_out // 2
            stack[0], stack[1] = stack[0][:, :half], stack[0][:, half:]
        return expert_batch(*stack, ids, x, wt_gu=gate.qtype, wt_d=down.qtype, exact=down.exact)
    parts = np.empty((T * k, x.shape[1]), F32)
    experts, offsets, pairs = group_by_expert(ids)
    for u, e in enumerate(experts):
        p = pairs[offsets[u]:offsets[u + 1]]
        parts[p] = expert_ffn(*w.expert(int(e)), x[p // k])
    return parts.reshape(T, k, -1)


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
