"""qsa.cu's wrappers: prep (norms, RoPE, caches, block pooling), block scores, top-k selection, split-K
attention and the gated merge. Cache layouts are documented in qsa.cu."""

from __future__ import annotations

import numpy as np

from strata.config import ModelConfig
from strata.cuda.arena import DevArray
from strata.cuda.launch import F, I, Launch, P, need

MAX_HEAD_DIM = 256      # QSA_MAXD in qsa.cu


def check_geometry(cfg: ModelConfig) -> None:
    if cfg.head_dim > MAX_HEAD_DIM:
        raise ValueError(f"qsa: head dim {cfg.head_dim} > {MAX_HEAD_DIM}, the attention kernel's register budget")
    if cfg.n_head // cfg.n_head_kv > 32:
        raise ValueError(f"qsa: {cfg.n_head // cfg.n_head_kv} query heads per kv head; one warp each, at most 32")


def prep_launch(fn, name: str, cfg: ModelConfig, il: int, qg: DevArray, kr: DevArray, vr: DevArray, iqr: DevArray,
                ikr: DevArray, q_norm: DevArray, k_norm: DevArray, iq_norm: DevArray, ik_norm: DevArray,
                inv_freq: DevArray, q: DevArray, Kc: DevArray, Vc: DevArray, iq: DevArray, idx_raw: DevArray,
                idx_blk: DevArray, step: DevArray, max_ctx: int) -> Launch:
    H, Hkv, D, Hi, Di, ratio = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.idx_heads, cfg.idx_dim, cfg.compress_ratios[il]
    check_geometry(cfg)
    need(qg, name + " q|gate", 2 * H * D)
    need(kr, name + " k", Hkv * D)
    need(vr, name + " v", Hkv * D)
    need(iqr, name + " indexer q", Hi * Di)
    need(ikr, name + " indexer k", Di)
    need(q_norm, name + " q_norm", D)
    need(k_norm, name + " k_norm", D)
    need(iq_norm, name + " indexer q_norm", Di)
    need(ik_norm, name + " indexer k_norm", Di)
    need(inv_freq, name + " inv_freq", cfg.n_rot // 2)
    need(q, name + " q out", H * D)
    need(Kc, name + " K cache", max_ctx * Hkv * D)
    need(Vc, name + " V cache", max_ctx * Hkv * D)
    need(iq, name + " indexer q out", Hi * Di)
    need(idx_raw, name + " indexer raw keys", max_ctx * Di)
    need(idx_blk, name + " indexer block keys", max_ctx // ratio * Di)
    need(step, name + " step", 8, np.int32)
    return Launch(fn, name, (H + Hkv + Hi + 1,), (128,), max(D, Di) * 4,
                  [P(qg), P(kr), P(vr), P(iqr), P(ikr), P(q_norm), P(k_norm), P(iq_norm), P(ik_norm), P(inv_freq),
                   P(q), P(Kc), P(Vc), P(iq), P(idx_raw), P(idx_blk), P(step), I(H), I(Hkv), I(D), I(Hi), I(Di),
                   I(cfg.n_rot), I(ratio), F(cfg.rms_eps)])


def score_launch(fn, name: str, cfg: ModelConfig, il: int, iq: DevArray, idx_blk: DevArray, scores: DevArray,
                 step: DevArray, max_ctx: int, n_sm: int) -> Launch:
    ratio = cfg.compress_ratios[il]
    max_blocks = max_ctx // ratio
    need(iq, name + " indexer q", cfg.idx_heads * cfg.idx_dim)
    need(idx_blk, name + " block keys", max_blocks * cfg.idx_dim)
    need(scores, name + " scores", max_blocks)
    need(step, name + " step", 8, np.int32)
    grid = max(1, min((max_blocks + 7) // 8, 4 * n_sm))     # grid-stride over the blocks that exist this step
    return Launch(fn, name, (grid,), (256,), 0,
                  [P(iq), P(idx_blk), P(scores), P(step), I(cfg.idx_heads), I(cfg.idx_dim), I(ratio),
                   I(cfg.block_topk(il))])


def select_launch(fn, name: str, cfg: ModelConfig, il: int, scores: DevArray, sel: DevArray, meta: DevArray,
                  step: DevArray, max_ctx: int) -> Launch:
    ratio = cfg.compress_ratios[il]
    need(scores, name + " scores", max_ctx // ratio)
    need(sel, name + " selection", max_ctx // ratio, np.int32)
    need(meta, name + " counts", 2, np.int32)
    need(step, name + " step", 8, np.int32)
    return Launch(fn, name, (1,), (1024,), 0, [P(scores), P(sel), P(meta), P(step), I(ratio), I(cfg.block_topk(il))])


def attn_launch(fn, name: str, cfg: ModelConfig, il: int, q: DevArray, Kc: DevArray, Vc: DevArray, sel: DevArray,
                meta: DevArray, part: DevArray, step: DevArray, max_ctx: int, nsplit: int) -> Launch:
    H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    check_geometry(cfg)
    need(q, name + " q", H * D)
    need(Kc, name + " K cache", max_ctx * Hkv * D)
    need(Vc, name + " V cache", max_ctx * Hkv * D)
    need(sel, name + " selection", 1, np.int32)
    need(meta, name + " counts", 2, np.int32)
    need(part, name + " partials", H * nsplit * (D + 2))
    need(step, name + " step", 8, np.int32)
    return Launch(fn, name, (Hkv, nsplit), (32 * (H // Hkv),), 0,
                  [P(q), P(Kc), P(Vc), P(sel), P(meta), P(part), P(step), I(Hkv), I(D), I(cfg.compress_ratios[il]),
                   I(nsplit)])


def combine_launch(fn, name: str, cfg: ModelConfig, part: DevArray, qg: DevArray, y: DevArray,
                   nsplit: int) -> Launch:
    H, D = cfg.n_head, cfg.head_dim
    need(part, name + " partials", H * nsplit * (D + 2))
    need(qg, name + " q|gate", 2 * H * D)
    need(y, name + " y", H * D)
    return Launch(fn, name, (H,), (256,), 0, [P(part), P(qg), P(y), I(D), I(nsplit)])
