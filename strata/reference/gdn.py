"""Gated DeltaNet over a chunk of one sequence's tokens: causal conv over the qkv projection, then the gated delta
rule, token by token inside the chunk with the state carried (a chunk of 1 is a decode step).

Value head h uses key head h % Hk: the converter reorders value heads from grouped-by-key-head to tiled.
T = rows in the step; a segment is one sequence's consecutive rows (its state, first row, row count).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from strata.config import ModelConfig
from strata.reference.common import F32, l2_norm, rms_norm, sigmoid, silu, softplus


@dataclass
class GdnState:
    conv: np.ndarray     # (K-1, conv_dim): the previous K-1 qkv projections, oldest first
    S: np.ndarray        # (Hv, Dk, Dv): the recurrent state per value head

    @classmethod
    def zeros(cls, cfg: ModelConfig) -> "GdnState":
        return cls(np.zeros((cfg.ssm_conv - 1, cfg.conv_dim), F32),
                   np.zeros((cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_state), F32))


@njit(nogil=True, cache=True)
def delta_rule(S, q, k, v, decay, beta, o):
    """The gated delta rule over n tokens, float32, sums in index order. S (Hv, Dk, Dv) in place; q, k (n, Hv, Dk)
    (q already scaled by 1/sqrt(Dk)); v (n, Hv, Dv); decay = exp(g), beta (n, Hv); o (n, Hv, Dv) out.
    Per head: S = decay S; delta = beta (v - S^T k); S += k delta^T; o = S^T q."""
    n, H, Dk = k.shape
    Dv = v.shape[2]
    mem = np.empty(Dv, np.float32)
    for t in range(n):
        for h in range(H):
            a, b = decay[t, h], beta[t, h]
            for j in range(Dv):
                mem[j] = np.float32(0.0)
            for i in range(Dk):
                ki = k[t, h, i]
                for j in range(Dv):
                    S[h, i, j] *= a
                    mem[j] += S[h, i, j] * ki
            for j in range(Dv):
                mem[j] = (v[t, h, j] - mem[j]) * b          # delta
            for j in range(Dv):
                o[t, h, j] = np.float32(0.0)
            for i in range(Dk):
                ki, qi = k[t, h, i], q[t, h, i]
                for j in range(Dv):
                    S[h, i, j] += ki * mem[j]
                    o[t, h, j] += S[h, i, j] * qi


def gdn_chunk(cfg: ModelConfig, w, segs, x: np.ndarray) -> np.ndarray:
    """x (T, E) -> out (T, E); segs [(GdnState, first row, rows)] cover the T rows, each state updated in place."""
    T = x.shape[0]
    Hk, Hv, D, kd = cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state, cfg.key_dim
    qkv = w.attn_qkv @ x                                     # (T, conv_dim)
    z = (w.attn_gate @ x).reshape(T, Hv, D)                  # (T, Hv, Dv)
    beta = sigmoid(w.ssm_beta @ x)                           # (T, Hv)
    decay = np.exp(w.ssm_a * softplus(w.ssm_alpha @ x + w.ssm_dt)).astype(F32)   # (T, Hv): exp(g), g <= 0

    # causal conv over [each run's K-1 previous inputs | its rows], all runs in one array: run s's rows sit at
    # base_s + K-1 .. base_s + K-1 + n_s, so row r of the step reads windows[at[r] - (K-1) + j], j = 0..K-1
    K = cfg.ssm_conv
    windows = np.concatenate([part for st, a, n in segs for part in (st.conv, qkv[a:a + n])], axis=0)
    base = np.cumsum([0] + [K - 1 + n for _, _, n in segs])
    at = np.concatenate([np.arange(b + K - 1, b + K - 1 + n) for b, (_, _, n) in zip(base, segs)])
    conv = windows[at - (K - 1)] * w.ssm_conv1d[:, 0]
    for j in range(1, K):
        conv += windows[at - (K - 1) + j] * w.ssm_conv1d[:, j]
    for (st, _, n), b in zip(segs, base[1:]):
        st.conv = windows[b - (K - 1):b]                     # the run's last K-1 inputs (a view of this step's)
    h = silu(conv)                                           # SiLU on the whole conv output

    kh = np.arange(Hv) % Hk                                  # tiled value heads
    q = (l2_norm(h[:, :kd].reshape(T, Hk, D)) / F32(np.sqrt(D)))[:, kh]       # (T, Hv, Dk)
    k = l2_norm(h[:, kd:2 * kd].reshape(T, Hk, D))[:, kh]
    v = np.ascontiguousarray(h[:, 2 * kd:].reshape(T, Hv, D))
    q, k = np.ascontiguousarray(q, F32), np.ascontiguousarray(k, F32)
    o = np.empty((T, Hv, D), F32)
    for st, a, n in segs:
        delta_rule(st.S, q[a:a + n], k[a:a + n], v[a:a + n], decay[a:a + n], beta[a:a + n], o[a:a + n])

    y = rms_norm(o, w.ssm_norm, cfg.rms_eps) * sigmoid(z)    # gated norm, sigmoid gate for qwen4exp
    return w.ssm_out @ y.reshape(T, -1).astype(F32)
