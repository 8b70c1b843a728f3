"""gdn.cu's wrapper: the fused Gated DeltaNet core of one layer (conv, norms, gates, state step, gated norm)."""

from __future__ import annotations

import numpy as np

from strata.config import ModelConfig
from strata.cuda.arena import DevArray
from strata.cuda.launch import F, I, Launch, P, need

CONV_CH = 4                     # gdn.cu GDN_CONV_CH: conv channels a thread of gdn_core
SCAN_SMEM = 2 * 16 * 340 * 4    # gdn_scan's dynamic shared memory: 2 stages of GDN_ROWS (16) rows of GDN_RS (340) floats


def block_shape(cfg: ModelConfig) -> tuple[int, int]:
    """(columns rounded to warps, ceil(Dk / 16) row groups): one thread per (value column, 16 state rows)."""
    Dk = Dv = cfg.ssm_state
    bx, ky = (Dv + 31) // 32 * 32, (Dk + 15) // 16
    if bx * ky > 1024:
        raise ValueError(f"gdn_core: head dim {Dk} needs {bx * ky} threads per CTA; at most 1024 (Dk <= 128 at "
                         f"Dv = 128)")
    return bx, ky


def gdn_core_launch(fn, name: str, cfg: ModelConfig, qkv: DevArray, z: DevArray, alpha: DevArray, beta: DevArray,
                    conv_w: DevArray, dt: DevArray, A: DevArray, norm_w: DevArray, ring: DevArray, S: DevArray,
                    y: DevArray, step: DevArray) -> Launch:
    Hk, Hv, D, K = cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_conv
    need(qkv, name + " qkv", cfg.conv_dim)
    need(z, name + " z", cfg.value_dim)
    need(alpha, name + " alpha", Hv)
    need(beta, name + " beta", Hv)
    need(conv_w, name + " conv1d", cfg.conv_dim * K)
    need(dt, name + " dt", Hv)
    need(A, name + " A", Hv)
    need(norm_w, name + " ssm_norm", D)
    need(ring, name + " conv ring", K * cfg.conv_dim)
    need(S, name + " state", Hv * D * D)
    need(y, name + " y", cfg.value_dim)
    need(step, name + " step", 8, np.int32)
    bx, ky = block_shape(cfg)
    if 2 * D + D > CONV_CH * bx * ky:
        raise ValueError(f"{name}: {3 * D} conv channels a head; {bx * ky} threads hold at most {CONV_CH} each")
    smem = (2 * D + D + ky * D) * 4
    return Launch(fn, name, (Hv,), (bx, ky), smem,
                  [P(qkv), P(z), P(alpha), P(beta), P(conv_w), P(dt), P(A), P(norm_w), P(ring), P(S), P(y), P(step),
                   I(Hk), I(Hv), I(D), I(D), I(K), F(cfg.rms_eps)])


def gdn_conv_launch(fn, name: str, cfg: ModelConfig, qkv: DevArray, conv_w: DevArray, ring: DevArray, c: DevArray,
                    step: DevArray, rows: int) -> Launch:
    """c[t] = silu(causal conv of row t) for the step's rows (a chunk of one sequence), rows at most."""
    K = cfg.ssm_conv
    need(qkv, name + " qkv", rows * cfg.conv_dim)
    need(c, name + " conv out", rows * cfg.conv_dim)
    need(conv_w, name + " conv1d", cfg.conv_dim * K)
    need(ring, name + " conv ring", K * cfg.conv_dim)
    need(step, name + " step", 8, np.int32)
    return Launch(fn, name, (min(-(-rows * cfg.conv_dim // 256), 4096),), (256,), 0,
                  [P(qkv), P(conv_w), P(ring), P(c), P(step), I(cfg.conv_dim), I(K)])


def gdn_prep_launch(fn, name: str, cfg: ModelConfig, c: DevArray, qkv: DevArray, alpha: DevArray, beta: DevArray,
                    dt: DevArray, A: DevArray, qn: DevArray, kn: DevArray, bt: DevArray, eg: DevArray, ring: DevArray,
                    step: DevArray, rows: int) -> Launch:
    """Per row: normalized q, k per key head and the gates per value head; the ring takes the chunk's last K raw
    rows."""
    Hk, Hv, D, K = cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_conv
    for a, what, n in ((c, "conv out", cfg.conv_dim), (qkv, "qkv", cfg.conv_dim), (alpha, "alpha", Hv),
                       (beta, "beta", Hv), (qn, "q", Hk * D), (kn, "k", Hk * D), (bt, "beta gate", Hv),
                       (eg, "decay", Hv)):
        need(a, f"{name} {what}", rows * n)
    for a, what, n in ((dt, "dt", Hv), (A, "A", Hv), (ring, "conv ring", K * cfg.conv_dim)):
        need(a, f"{name} {what}", n)
    need(step, name + " step", 8, np.int32)
    return Launch(fn, name, (Hk, rows), (128,), 0,
                  [P(c), P(qkv), P(alpha), P(beta), P(dt), P(A), P(qn), P(kn), P(bt), P(eg), P(ring), P(step), I(Hk),
                   I(Hv), I(D), I(D), I(K)])


def gdn_scan_launch(fn, name: str, cfg: ModelConfig, qn: DevArray, kn: DevArray, c: DevArray, bt: DevArray,
                    eg: DevArray, S: DevArray, o: DevArray, step: DevArray, rows: int) -> Launch:
    """The delta rule over the step's rows in order, each state column in registers for the whole chunk."""
    Hk, Hv, D = cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state
    if D > 128:
        raise ValueError(f"{name}: key head dim {D} > 128 (8 lanes of 16 state rows per column)")
    for a, what, n in ((qn, "q", Hk * D), (kn, "k", Hk * D), (c, "conv out", cfg.conv_dim), (bt, "beta gate", Hv),
                       (eg, "decay", Hv), (o, "out", cfg.value_dim)):
        need(a, f"{name} {what}", rows * n)
    need(S, name + " state", Hv * D * D)
    need(step, name + " step", 8, np.int32)
    return Launch(fn, name, (Hv, -(-D // 16)), (128,), SCAN_SMEM,
                  [P(qn), P(kn), P(c), P(bt), P(eg), P(S), P(o), P(step), I(Hk), I(Hv), I(D), I(D)])


def gdn_out_launch(fn, name: str, cfg: ModelConfig, o: DevArray, z: DevArray, norm_w: DevArray, y: DevArray,
                   step: DevArray, rows: int) -> Launch:
    """y = RMSNorm(o) * ssm_norm * sigmoid(z) per head and row."""
    Hv, D = cfg.ssm_v_heads, cfg.ssm_state
    for a, what in ((o, "out"), (z, "z"), (y, "y")):
        need(a, f"{name} {what}", rows * cfg.value_dim)
    need(norm_w, name + " ssm_norm", D)
    need(step, name + " step", 8, np.int32)
    return Launch(fn, name, (Hv, rows), (128,), 0, [P(o), P(z), P(norm_w), P(y), P(step), I(Hv), I(D),
                                                    F(cfg.rms_eps)])
