"""Hyper-connections (the gated residual): `hc` residual streams read into one mixer input and written back.

R: (T, hc, E) raw streams, one row per token. gr_read normalizes them per stream, gates them with a low-rank mixer
and averages; gr_write adds the block's output to every stream scaled by that stream's inject weight.
"""

from __future__ import annotations

import numpy as np

from strata.reference.common import F32, rms_norm, sigmoid, silu


def gr_read(R: np.ndarray, norm: np.ndarray, down, up, inject, eps: float) -> tuple[np.ndarray, np.ndarray | None]:
    """R (T, hc, E) -> mixed (T, E), inject weights (T, hc) or None for the final mixer (which has no inject)."""
    T, hc, E = R.shape
    xn = rms_norm(R, norm, eps).reshape(T, hc * E)          # grouped RMSNorm, one group per stream
    lo = silu((down @ xn) / F32(hc))                         # (T, r)
    g = sigmoid(up @ lo).reshape(T, hc, E)
    mixed = np.mean(g * xn.reshape(T, hc, E), axis=1, dtype=F32)
    inj = None if inject is None else (F32(2.0) * sigmoid((inject @ xn) / F32(hc)))
    return mixed, inj


def gr_write(R: np.ndarray, inject: np.ndarray, out: np.ndarray) -> np.ndarray:
    """R_s += inject_s * out for every stream s (R is the raw streams, not the normalized ones); out (T, E)."""
    return (R + inject[:, :, None] * out[:, None, :]).astype(F32)
