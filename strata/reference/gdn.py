"""Gated DeltaNet, one token at a time: causal conv over the qkv projection, then the gated delta rule.

Value head h uses key head h % Hk: the converter reorders value heads from grouped-by-key-head to tiled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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


def gdn_step(cfg: ModelConfig, w, st: GdnState, x: np.ndarray) -> np.ndarray:
    """x (E,) -> out (E,); updates st in place."""
    Hk, Hv, D, kd = cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state, cfg.key_dim
    qkv = w.attn_qkv @ x                                     # (conv_dim,)
    z = (w.attn_gate @ x).reshape(Hv, D)                     # (Hv, Dv)
    beta = sigmoid(w.ssm_beta @ x)                           # (Hv,)
    g = w.ssm_a * softplus(w.ssm_alpha @ x + w.ssm_dt)       # (Hv,) log of the decay, <= 0

    window = np.concatenate([st.conv, qkv[None, :]], axis=0)  # (K, conv_dim)
    st.conv = window[1:].copy()
    h = silu(np.einsum("kc,ck->c", window, w.ssm_conv1d, dtype=F32))  # SiLU on the whole conv output

    q = l2_norm(h[:kd].reshape(Hk, D)) / F32(np.sqrt(D))
    k = l2_norm(h[kd:2 * kd].reshape(Hk, D))
    v = h[2 * kd:].reshape(Hv, D)
    kh = np.arange(Hv) % Hk                                  # tiled value heads
    q, k = q[kh], k[kh]                                      # (Hv, Dk)

    S = st.S * np.exp(g).astype(F32)[:, None, None]
    kv_mem = np.einsum("hkv,hk->hv", S, k, dtype=F32)
    delta = (v - kv_mem) * beta[:, None]
    S = S + k[:, :, None] * delta[:, None, :]
    st.S = S.astype(F32)
    o = np.einsum("hkv,hk->hv", st.S, q, dtype=F32)          # (Hv, Dv)

    y = rms_norm(o, w.ssm_norm, cfg.rms_eps) * sigmoid(z)    # gated norm, sigmoid gate for qwen4exp
    return w.ssm_out @ y.reshape(-1).astype(F32)
