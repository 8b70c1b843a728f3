"""Elementwise pieces shared by every block, in float32 like the transformers reference."""

from __future__ import annotations

import numpy as np

from strata.quant.dequant import dequantize_rows
from strata.quant.formats import QType

F32 = np.float32


def table_rows(m, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` (n,) of a Mat dequantized, (n, n_in) float32: Mat.row for a whole step's lookups in one call."""
    m._check()
    raw = m.raw.view(np.uint8) if m.qtype == QType.F32 else m.raw
    return dequantize_rows(raw, m.qtype, rows).reshape(len(rows), m.n_in).astype(F32)


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis; `w` is the stored gamma ((1 + w) already folded in by the converter)."""
    y = x * (F32(1.0) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True, dtype=F32) + F32(eps)))
    return y if w is None else y * w


def l2_norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    # transformers' l2norm: x * rsqrt(sum(x^2) + 1e-6), the FLA convention (eps is not rms_norm_eps)
    return x * (F32(1.0) / np.sqrt(np.sum(x * x, axis=-1, keepdims=True, dtype=F32) + F32(eps)))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return (F32(1.0) / (F32(1.0) + np.exp(-x))).astype(F32)


def silu(x: np.ndarray) -> np.ndarray:
    return (x * sigmoid(x)).astype(F32)


def softplus(x: np.ndarray) -> np.ndarray:
    # torch's softplus: linear above threshold 20
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(F32)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(F32)


def rope_inv_freq(n_rot: int, base: float) -> np.ndarray:
    # computed in float32 as transformers does, so positions far out rotate by the same angles
    exps = np.arange(0, n_rot, 2, dtype=F32) / F32(n_rot)
    return (F32(1.0) / np.power(F32(base), exps, dtype=F32)).astype(F32)


def rope(x: np.ndarray, pos, inv_freq: np.ndarray) -> np.ndarray:
    """NEOX RoPE on the first 2*len(inv_freq) dims of x (T, heads, dim), row t at position pos[t] (an int: every
    row at that position); pairs (i, i + n_rot/2)."""
    half = inv_freq.shape[0]
    ang = np.asarray(pos, F32).reshape(-1, 1, 1) * inv_freq          # (T or 1, 1, half)
    cos, sin = np.cos(ang).astype(F32), np.sin(ang).astype(F32)
    out = x.copy()
    x1, x2 = x[..., :half], x[..., half:2 * half]
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:2 * half] = x2 * cos + x1 * sin
    return out
