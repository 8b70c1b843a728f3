"""qsa.cu's wrappers: prep (norms, RoPE, caches, block pooling), block scores, top-k selection, split-K
attention and the gated merge. Cache layouts are documented in qsa.cu."""

from __future__ import annotations

import numpy as np

from strata.config import ModelConfig
from strata.cuda.arena import DevArray
from strata.cuda.launch import F, I, Launch, P, need
from strata.kernels.build import define

MAX_HEAD_DIM = 256      # QSA_MAXD in qsa.cu
MAX_GROUP = 32          # query heads per kv head: the attention CTA's warps (8 at QSA_HW 4) stay within 256 threads


def attn_warps(cfg: ModelConfig) -> int:
    """Warps of a qsa_attn CTA: the kv head's group of query heads, QSA_HW heads a warp."""
    return -(-(cfg.n_head // cfg.n_head_kv) // define("QSA_HW", 4))


def attn_cap(cfg: ModelConfig, il: int, nsplit: int) -> int:
    """Cells of one attention split at most: a query attends at most budget + ratio - 1 cells (its top blocks, or
    every complete block while they fit the budget, and the incomplete tail)."""
    return -(-(cfg.idx_budget + cfg.compress_ratios[il]) // nsplit)


def attn_smem(cfg: ModelConfig, il: int, nsplit: int) -> int:
    """qsa_attn's dynamic shared memory: QSA_STAGES rounds of QSA_U cells' K and V rows, then a split's cells."""
    return define("QSA_STAGES", 2) * define("QSA_U", 8) * 2 * cfg.head_dim * 4 + 4 * attn_cap(cfg, il, nsplit)


def attn_tc_smem(cfg: ModelConfig, il: int, nsplit: int) -> int:
    """qsa_attn_tc's dynamic shared memory: QSA_TC_STAGES rounds of 16 cells' K rows (stride Dp + 4 floats, Dp the
    head dim padded to 8 dims a warp) and V rows (Dp + 8), then a split's cells."""
    per = 8 * define("QSA_TC_W", 8)           # dims padded to 8 a warp
    dp = -(-cfg.head_dim // per) * per
    return define("QSA_TC_STAGES", 2) * 16 * (2 * dp + 12) * 4 + 4 * attn_cap(cfg, il, nsplit)


def check_geometry(cfg: ModelConfig) -> None:
    if cfg.head_dim > MAX_HEAD_DIM:
        raise ValueError(f"qsa: head dim {cfg.head_dim} > {MAX_HEAD_DIM}, the attention kernel's register budget")
    if cfg.n_head // cfg.n_head_kv > MAX_GROUP or attn_warps(cfg) > 8:
        raise ValueError(f"qsa: {cfg.n_head // cfg.n_head_kv} query heads per kv head; the attention kernel takes "
                         f"at most {MAX_GROUP}")


def prep_launch(fn, name: str, cfg: ModelConfig, il: int, qg: DevArray, kr: DevArray, vr: DevArray, iqr: DevArray,
                ikr: DevArray, q_norm: DevArray, k_norm: DevArray, iq_norm: DevArray, ik_norm: DevArray,
                inv_freq: DevArray, q: DevArray, Kc: DevArray, Vc: DevArray, iq: DevArray, idx_raw: DevArray,
                idx_blk: DevArray, step: DevArray, max_ctx: int, rows: int = 1) -> Launch:
    """rows = 1: the one-token path, pooling a block it completes; rows > 1: a chunk, pooled by pool_launch."""
    H, Hkv, D, Hi, Di, ratio = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.idx_heads, cfg.idx_dim, cfg.compress_ratios[il]
    check_geometry(cfg)
    need(qg, name + " q|gate", rows * 2 * H * D)
    need(kr, name + " k", rows * Hkv * D)
    need(vr, name + " v", rows * Hkv * D)
    need(iqr, name + " indexer q", rows * Hi * Di)
    need(ikr, name + " indexer k", rows * Di)
    need(q_norm, name + " q_norm", D)
    need(k_norm, name + " k_norm", D)
    need(iq_norm, name + " indexer q_norm", Di)
    need(ik_norm, name + " indexer k_norm", Di)
    need(inv_freq, name + " inv_freq", cfg.n_rot // 2)
    need(q, name + " q out", rows * H * D)
    need(Kc, name + " K cache", max_ctx * Hkv * D)
    need(Vc, name + " V cache", max_ctx * Hkv * D)
    need(iq, name + " indexer q out", rows * Hi * Di)
    need(idx_raw, name + " indexer raw keys", max_ctx * Di)
    need(idx_blk, name + " indexer block keys", max_ctx // ratio * Di)
    need(step, name + " step", 8, np.int32)
    return Launch(fn, name, (H + Hkv + Hi + 1, rows), (128,), max(D, Di) * 4,
                  [P(qg), P(kr), P(vr), P(iqr), P(ikr), P(q_norm), P(k_norm), P(iq_norm), P(ik_norm), P(inv_freq),
                   P(q), P(Kc), P(Vc), P(iq), P(idx_raw), P(idx_blk), P(step), I(H), I(Hkv), I(D), I(Hi), I(Di),
                   I(cfg.n_rot), I(ratio), F(cfg.rms_eps), I(rows == 1)])


def pool_launch(fn, name: str, cfg: ModelConfig, il: int, idx_raw: DevArray, idx_blk: DevArray, ik_norm: DevArray,
                inv_freq: DevArray, step: DevArray, max_ctx: int, rows: int) -> Launch:
    """The indexer block keys of the blocks a chunk of up to `rows` rows completes."""
    Di, ratio = cfg.idx_dim, cfg.compress_ratios[il]
    need(idx_raw, name + " indexer raw keys", max_ctx * Di)
    need(idx_blk, name + " indexer block keys", max_ctx // ratio * Di)
    need(ik_norm, name + " indexer k_norm", Di)
    need(inv_freq, name + " inv_freq", cfg.n_rot // 2)
    need(step, name + " step", 8, np.int32)
    return Launch(fn, name, (-(-rows // ratio),), (128,), Di * 4,
                  [P(idx_raw), P(idx_blk), P(ik_norm), P(inv_freq), P(step), I(Di), I(cfg.n_rot), I(ratio),
                   F(cfg.rms_eps)])


def score_launch(fn, name: str, cfg: ModelConfig, il: int, iq: DevArray, idx_blk: DevArray, scores: DevArray,
                 step: DevArray, max_ctx: int, n_sm: int, rows: int = 1, ld: int | None = None) -> Launch:
    """ld: the row stride of scores (rows > 1), at least max_ctx // ratio."""
    ratio = cfg.compress_ratios[il]
    max_blocks = max_ctx // ratio
    ld = ld or max_blocks
    need(iq, name + " indexer q", rows * cfg.idx_heads * cfg.idx_dim)
    need(idx_blk, name + " block keys", max_blocks * cfg.idx_dim)
    need(scores, name + " scores", (rows - 1) * ld + max_blocks)
    need(step, name + " step", 8, np.int32)
    grid = max(1, min((max_blocks + 7) // 8, max(1, 4 * n_sm // rows)))   # grid-stride over the blocks of a row
    return Launch(fn, name, (grid, rows), (256,), 0,
                  [P(iq), P(idx_blk), P(scores), P(step), I(cfg.idx_heads), I(cfg.idx_dim), I(ratio),
                   I(cfg.block_topk(il)), I(ld)])


def select_launch(fn, name: str, cfg: ModelConfig, il: int, scores: DevArray, sel: DevArray, meta: DevArray,
                  step: DevArray, max_ctx: int, rows: int = 1, ld: int | None = None) -> Launch:
    ratio = cfg.compress_ratios[il]
    ld = ld or max_ctx // ratio
    need(scores, name + " scores", (rows - 1) * ld + max_ctx // ratio)
    need(sel, name + " selection", (rows - 1) * ld + max_ctx // ratio, np.int32)
    need(meta, name + " counts", 2 * rows, np.int32)
    need(step, name + " step", 8, np.int32)
    return Launch(fn, name, (rows,), (1024,), 0,
                  [P(scores), P(sel), P(meta), P(step), I(ratio), I(cfg.block_topk(il)), I(ld)])


def attn_launch(fn_of, name: str, cfg: ModelConfig, il: int, q: DevArray, Kc: DevArray, Vc: DevArray,
                sel: DevArray, meta: DevArray, part: DevArray, step: DevArray, max_ctx: int, nsplit: int, rows: int = 1,
                ld: int | None = None, tc: bool = False) -> Launch:
    """qsa_attn (tc False: the token's one row, FMA pipes, a CTA per kv head) or qsa_attn_tc (tc True: the batched
    step's rows, tensor cores, 16 query heads of a kv head a CTA); the same arguments and partials. fn_of(kernel
    name) -> the function."""
    H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    ld = ld or max_ctx // cfg.compress_ratios[il]
    check_geometry(cfg)
    need(q, name + " q", rows * H * D)
    need(Kc, name + " K cache", max_ctx * Hkv * D)
    need(Vc, name + " V cache", max_ctx * Hkv * D)
    need(sel, name + " selection", 1, np.int32)
    need(meta, name + " counts", 2 * rows, np.int32)
    need(part, name + " partials", rows * H * nsplit * (D + 2))
    need(step, name + " step", 8, np.int32)
    if tc:
        grid = (Hkv * -(-(H // Hkv) // 16), nsplit, rows)
        block, smem = 32 * define("QSA_TC_W", 8), attn_tc_smem(cfg, il, nsplit)
    else:
        grid, block, smem = (Hkv, nsplit, rows), 32 * attn_warps(cfg), attn_smem(cfg, il, nsplit)
    return Launch(fn_of("qsa_attn_tc" if tc else "qsa_attn"), name, grid, (block,), smem,
                  [P(q), P(Kc), P(Vc), P(sel), P(meta), P(part), P(step), I(H), I(Hkv), I(D),
                   I(cfg.compress_ratios[il]), I(nsplit), I(ld), I(attn_cap(cfg, il, nsplit))])


def combine_launch(fn, name: str, cfg: ModelConfig, part: DevArray, qg: DevArray, y: DevArray,
                   nsplit: int, step: DevArray, rows: int = 1) -> Launch:
    H, D = cfg.n_head, cfg.head_dim
    need(part, name + " partials", rows * H * nsplit * (D + 2))
    need(qg, name + " q|gate", rows * 2 * H * D)
    need(y, name + " y", rows * H * D)
    need(step, name + " step", 8, np.int32)
    return Launch(fn, name, (H, rows), (256,), 0, [P(part), P(qg), P(y), I(D), I(nsplit), P(step)])
