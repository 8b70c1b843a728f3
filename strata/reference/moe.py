"""MoE: softmax router with renormalized top-k, routed SwiGLU experts, a sigmoid-gated shared expert.

The split matters to the scheduler: `route` ends the `pre` stage (the doorbell), `expert_ffn` is what the
CPU pool or a VRAM-resident expert computes between the stages, `combine` starts `post`.
"""

from __future__ import annotations

import numpy as np

from strata.config import ModelConfig
from strata.reference.common import F32, sigmoid, silu, softmax


def route(cfg: ModelConfig, w, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (E,) -> expert ids (k,) int32 in descending probability, weights (k,) summing to 1."""
    p = softmax(w.ffn_gate_inp @ x)
    ids = np.argsort(-p, kind="stable")[:cfg.n_expert_used]
    wts = p[ids] / p[ids].sum(dtype=F32)
    return ids.astype(np.int32), wts.astype(F32)


def expert_ffn(gate, up, down, x: np.ndarray) -> np.ndarray:
    """One SwiGLU expert: down @ (silu(gate @ x) * (up @ x))."""
    return down @ (silu(gate @ x) * (up @ x)).astype(F32)


def shared_expert(w, x: np.ndarray) -> np.ndarray:
    y = expert_ffn(w.ffn_gate_shexp, w.ffn_up_shexp, w.ffn_down_shexp, x)
    return y * sigmoid(np.dot(w.ffn_gate_inp_shexp, x).astype(F32))


def combine(weights: np.ndarray, parts: np.ndarray, shared: np.ndarray) -> np.ndarray:
    """sum_j w_j * parts_j + shared; parts (k, E) must be THIS layer's experts for THIS layer's weights."""
    return (np.einsum("k,ke->e", weights, parts, dtype=F32) + shared).astype(F32)
