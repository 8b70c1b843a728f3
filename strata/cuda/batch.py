"""The CUDA backend's batched steps: T rows of one sequence (a prompt chunk) per step, with the stage names and the
pre/post split of the one-token path (strata.cuda.backend), for T up to the backend's max_step_tokens.

Every matrix product is a GEMM (strata/kernels/gemm.cu: a weight tile decoded once and applied to all rows on the
tensor cores); GDN runs the chunk with its state on chip (gdn_conv, gdn_prep, then gdn_scan: the recurrence alone,
a state column per 8 lanes for the whole chunk, then gdn_out); QSA appends the chunk's keys, pools the blocks it
completes, and each query selects and attends its own cells; the MoE groups the step's (row, choice) pairs by
expert on the device (moe_group) and runs one grouped GEMM over every used expert's rows; the head runs on the
step's logit rows only.

Graphs are captured per bucket of rows (BUCKETS up to max_step_tokens) at fixed addresses: the step's row count,
tokens, positions and logit rows are device data (the step block), so one bucket's graphs serve every T up to it.

Buffers (rows = max_step_tokens, f32 unless noted): R, xn (rows, hc, E); lo_raw, lo (rows, hc_rank); G (rows,
hc*E); inj_a, inj_f (rows, hc); mixed, mix_out, x_ffn, shared, comb (rows, E); router logits (rows, n_exp); ids
i32, wts (rows, k); pairs: pair_tok, pair_of i32 (rows*k), h (rows*k, Fp), out (rows*k, E); tiles i32 (max, 4).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from strata.cuda import driver as drv
from strata.cuda.arena import DevArray, Section
from strata.cuda.graphs import Graph
from strata.cuda.launch import CopyH2D
from strata.kernels import gdn as kgdn
from strata.kernels import gemm as kgemm
from strata.kernels import gemv as kgemv
from strata.kernels import hc as khc
from strata.kernels import moe as kmoe
from strata.kernels import ple as kple
from strata.kernels import qsa as kqsa
from strata.kernels.gemm import GemmJob

F32, I32, U8 = np.float32, np.int32, np.uint8
BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096)   # graph sets for steps of up to this many rows (and max_step_tokens)
NSPLIT = 4                               # QSA attention splits per query: the rows give the parallelism
LOGIT_BYTES = 256 << 20                  # device bytes for a step's logit rows (flash: 270 rows of 248,320)


def buckets(max_rows: int) -> tuple[int, ...]:
    return tuple(sorted({b for b in BUCKETS if b < max_rows} | {max_rows}))


class BatchPath:
    """Owned by a CudaBackend `be` with max_step_tokens > 1: plan() before the arena's commit, build() after it,
    capture() for the graphs; then begin/pre/post/head per step (the backend checks the protocol)."""

    def __init__(self, be, rows: int):
        self.be, self.rows = be, rows
        cfg = be.cfg
        self.logit_rows = max(1, min(rows, LOGIT_BYTES // (4 * cfg.n_vocab)))
        self.buckets = buckets(rows)
        self.tile_plan = kmoe.tile_plan(rows, cfg.n_expert_used, cfg.n_expert)

    # ---- planning -----------------------------------------------------------------------------------------
    def plan(self) -> None:
        be, cfg, Tm = self.be, self.be.cfg, self.rows
        # the step's activations go in a section the backend places after the expert cache's slots: rewritten by
        # every step before they are read, they can hold experts between batched steps (backend lent_slots).
        # Tables written once at setup (job tables, the tile lists' ticket) stay in the arena proper
        self.act = Section("batched step activations")
        # buffers of the step's rows or its (row, expert) pairs (a step of B rows writes their first B rows or B k
        # pairs: touched), with their bytes a step row; the head's buffers are whole (its graph serves every
        # bucket and runs its kernels over all its rows)
        self._act_rows: list[tuple[DevArray, int]] = []
        R = self._act
        Rr = lambda name, shape, dtype=F32: self._act(name, shape, dtype, per_row=True)  # noqa: E731
        E, hc, k, r = cfg.n_embd, cfg.hc, cfg.n_expert_used, cfg.hc_rank
        self.R = Rr("b.R", (Tm, hc, E))
        self.xn = Rr("b.xn", (Tm, hc, E))
        self.lo_raw = Rr("b.lo_raw", (Tm, r))
        self.lo = Rr("b.lo", (Tm, r))
        self.G = Rr("b.G", (Tm, hc * E))
        self.inj_a = Rr("b.inject_attn", (Tm, hc))
        self.inj_f = Rr("b.inject_ffn", (Tm, hc))
        self.mixed = Rr("b.mixed", (Tm, E))
        self.mix_out = Rr("b.mixer_out", (Tm, E))
        self.x_ffn = Rr("b.x_ffn", (Tm, E))
        self.logits_r = Rr("b.router_logits", (Tm, cfg.n_expert))
        self.sg = Rr("b.shexp_gate", (Tm, 1))
        self.ids = Rr("b.ids", (Tm, k), I32)
        self.wts = Rr("b.weights", (Tm, k))
        self.h_sh = Rr("b.h_shared", (Tm, cfg.n_ff_shexp))
        self.shared = Rr("b.shared", (Tm, E))
        self.comb = Rr("b.combine", (Tm, E))
        Fp = kmoe.padded_ff(cfg)
        self.pair_tok = Rr("b.pair_rows", (Tm * k,), I32)
        self.pair_of = Rr("b.pair_of", (Tm * k,), I32)
        self.h_exp = Rr("b.h_experts", (Tm * k, Fp))
        self.out_exp = Rr("b.expert_out", (Tm * k, E))
        tp = self.tile_plan
        self.tiles = be.A.reserve("b.tiles", (4 * (tp.cap + tp.cap2),), I32)
        self.n_tiles = be.A.reserve("b.n_tiles", (2,), I32)
        self.ticket = be.A.reserve("b.ticket", (1,), np.uint32)
        if be.experts == "host":
            self.slot_of = be.A.reserve("b.slot_of", (cfg.n_expert,), I32)
            self.host_parts = Rr("b.host_parts", (Tm * k, E))
        L = self.logit_rows
        self.xh = R("b.head_xn", (L, hc, E))
        self.lo_h = R("b.head_lo_raw", (L, r))
        self.lo_ha = R("b.head_lo", (L, r))
        self.G_h = R("b.head_G", (L, hc * E))
        self.mixed_h = R("b.head_mixed", (L, E))
        self.logits = R("b.logits", (L, cfg.n_vocab))
        if any(cfg.recurrent):
            self.qkv = Rr("b.gdn_qkv", (Tm, cfg.conv_dim))
            self.conv = Rr("b.gdn_conv", (Tm, cfg.conv_dim))
            self.z = Rr("b.gdn_z", (Tm, cfg.value_dim))
            self.alpha = Rr("b.gdn_alpha", (Tm, cfg.ssm_v_heads))
            self.beta = Rr("b.gdn_beta", (Tm, cfg.ssm_v_heads))
            self.y = Rr("b.gdn_y", (Tm, cfg.value_dim))
            self.qn = Rr("b.gdn_q", (Tm, cfg.ssm_k_heads, cfg.ssm_state))
            self.kn = Rr("b.gdn_k", (Tm, cfg.ssm_k_heads, cfg.ssm_state))
            self.bt = Rr("b.gdn_beta_gate", (Tm, cfg.ssm_v_heads))
            self.eg = Rr("b.gdn_decay", (Tm, cfg.ssm_v_heads))
            self.o = Rr("b.gdn_o", (Tm, cfg.value_dim))
        if not all(cfg.recurrent):
            H, Hkv, D, Hi, Di = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.idx_heads, cfg.idx_dim
            self.ld_blocks = max(be.max_ctx // cfg.compress_ratios[i] for i in range(cfg.n_layer)
                                 if not cfg.recurrent[i])
            self.qg = Rr("b.qsa_q_gate", (Tm, H, 2 * D))
            self.kr = Rr("b.qsa_k", (Tm, Hkv * D))
            self.vr = Rr("b.qsa_v", (Tm, Hkv * D))
            self.iqr = Rr("b.qsa_iq_raw", (Tm, Hi * Di))
            self.ikr = Rr("b.qsa_ik_raw", (Tm, Di))
            self.q = Rr("b.qsa_q", (Tm, H, D))
            self.iq = Rr("b.qsa_iq", (Tm, Hi, Di))
            self.scores = Rr("b.qsa_scores", (Tm, self.ld_blocks))
            self.sel = Rr("b.qsa_sel", (Tm, self.ld_blocks), I32)
            self.meta = Rr("b.qsa_meta", (Tm, 2), I32)
            self.part = Rr("b.qsa_partials", (Tm, H, NSPLIT, D + 2))
            self.att = Rr("b.qsa_att", (Tm, H * D))
        if cfg.ple_layers:
            self.ple_e = Rr("b.ple_e", (Tm, cfg.ple_dim))
            self.ple_key = Rr("b.ple_key_raw", (Tm, cfg.hc_dim))
            self.ple_value = Rr("b.ple_value", (Tm, E))
            self.ple_gate = Rr("b.ple_gate", (Tm, cfg.hc))
        self._xsplits: dict = {}
        # x split once per launch where the tiles can copy it: Hopper's wgmma tile (gemm.py XPREP)
        self.xprep = bool(kgemm.XPREP) and be.dev.arch == 90
        # weights split once per launch in the buckets of many rows (gemm.py WPREP): one scratch for every op's
        # planes (the ops of a step run in order on one stream), sized for the largest op
        self.wprep = bool(kgemm.WPREP) and be.dev.arch == 90 and Tm >= kgemm.WPREP_MIN_ROWS
        self._wsplit_bytes = 0
        # split-K launches' slices (gemm.py k_slices): one buffer for every op, sized for the largest (the ops of a
        # step run in order on one stream)
        self._ksplit_floats = 0
        self._plan_tile_splits(self.tile_plan)
        self._ops = self._plan_ops()
        self.wsplit_buf = R("b.wsplit", (self._wsplit_bytes,), U8) if self._wsplit_bytes else None
        self.ksplit_buf = R("b.ksplit", (self._ksplit_floats,)) if self._ksplit_floats else None

    def _act(self, name: str, shape, dtype=F32, per_row: bool = False):
        """A buffer of the activations' section; per_row: its first axis is the step's rows (a step writes only
        its first rows: touched)."""
        a = self.be.A.reserve(name, shape, dtype, section=self.act)
        if per_row:
            self._act_rows.append((a, a.nbytes // self.rows))
        return a

    def touched(self, bucket: int) -> np.ndarray:
        """(n, 2) byte ranges of the activations' section that a step of this bucket may write or read as part of
        a row it computes: its first rows (or their pairs) of every buffer of rows, rounded up to 128 rows (a GEMM
        tile's), and all of every other buffer (the head's, the split planes: their layouts are not by step row).
        tests/test_cuda_backend.py checks that a step writes nothing else."""
        rows = min(self.rows, -(-bucket // 128) * 128)
        per_row = {id(a): rb for a, rb in self._act_rows}
        out = []
        for a in self.be.A.items:
            if a.section is self.act:
                rb = per_row.get(id(a))
                n = a.nbytes if rb is None else min(a.nbytes, rows * rb)
                out.append((a.offset, a.offset + n + 32))      # the 32 spare bytes of vector reads
        return np.array(out, np.int64).reshape(-1, 2)

    def touched_slots(self, bucket: int, slot_bytes: int, n: int) -> np.ndarray:
        """Which of the section's first n pieces of slot_bytes (the cache slots lent from it) a step of this bucket
        touches."""
        r, lo = self.touched(bucket), np.arange(n, dtype=np.int64) * slot_bytes
        return np.flatnonzero(((r[:, 0][None, :] < (lo + slot_bytes)[:, None]) & (r[:, 1][None, :] > lo[:, None]))
                              .any(1))

    def _gemm(self, name: str, jobs: list[GemmJob], n_rows=None):
        """A GEMM op: its job table reserved now, its launches (one per bucket) built later. With GEMM_XPREP (gemm.py
        XPREP) a step's plain jobs read their rows split once by x_split launches ahead of the GEMM (one per
        distinct x, into a buffer per x, input length and k-chunk that every op of the step reuses)."""
        table = kgemm.job_table(name + ".gemm_jobs", len(jobs), self.be.A.reserve)
        preps: list = []
        if (self.xprep and n_rows is None and all(j.w2 is None and j.xrow is None for j in jobs)
                and sum(j.w.n_out for j in jobs) >= kgemm.XPREP_MIN_OUT):
            bk = kgemm.chunk_k([j.w.qtype for j in jobs])
            jobs = [self._prepared(j, bk, preps) for j in jobs]
        wplan = self._wplan(name, jobs) if self.wprep and n_rows is None else None
        part_ld = sum(j.w.n_out for j in jobs)
        for rows in (*self.buckets, self.logit_rows):
            ks = kgemm.k_slices(jobs, rows, self.be.dev.n_sm)
            if ks > 1:
                self._ksplit_floats = max(self._ksplit_floats, ks * rows * part_ld)
        return ("gemm", name, table, jobs, n_rows, preps, wplan)

    def _gemms(self, name: str, jobs: list[GemmJob]) -> list:
        """The mixers' input projections as GEMM ops: a launch's tile shape follows its narrowest matrix (gemm.py
        shape_for), so with GEMM_NARROW_APART the matrices of fewer than WIDE_OUT outputs (GDN's alpha and beta, 48
        at flash; QSA's k, v and indexer projections) go in a launch of their own and the wide ones take the 64 x 128
        tiles (at flash, 4096 rows: gdn_proj 3.49 ms a layer in 64 x 64 tiles, attn_qkv alone 1.93 of it in
        64 x 128)."""
        wide = [j for j in jobs if j.w.n_out >= kgemm.WIDE_OUT]
        narrow = [j for j in jobs if j.w.n_out < kgemm.WIDE_OUT]
        if not (kgemm.NARROW_APART and wide and narrow):
            return [self._gemm(name, jobs)]
        return [self._gemm(name, wide), self._gemm(name + "_narrow", narrow)]

    def _wplan(self, name: str, jobs: list[GemmJob]):
        """With GEMM_WPREP: the op's weight planes' offsets in the shared scratch (each job's matrix and GLU partner),
        the k-chunk, and the job table of the buckets that use them (the others' table has no planes)."""
        bk = kgemm.chunk_k([j.w.qtype for j in jobs] + [j.w2.qtype for j in jobs if j.w2 is not None])
        at, places = 0, []
        for j in jobs:
            offs = []
            for w in (j.w, j.w2):
                offs.append(None if w is None else at)
                if w is not None:
                    at += -(-kgemm.xsplit_bytes(w.n_in, bk, w.n_out) // 256) * 256
            places.append(offs)
        self._wsplit_bytes = max(self._wsplit_bytes, at)
        return kgemm.job_table(name + ".gemm_jobs_wprep", len(jobs), self.be.A.reserve), bk, places

    def _wsplits(self, name: str, jobs: list[GemmJob], wplan) -> tuple[list[GemmJob], list]:
        """The op's jobs reading their weights' planes, and the (matrix, index, split) each w_split launch fills."""
        _, bk, places = wplan
        out, fills = [], []

        def split(w, off, what):
            buf = self.wsplit_buf.view(what, off, (kgemm.xsplit_bytes(w.n_in, bk, w.n_out),), U8)
            return kgemm.XSplit(buf, w.n_in, bk, w.n_out)
        for i, (j, (o, o2)) in enumerate(zip(jobs, places)):
            ws = split(j.w, o, f"{name}.{i}")
            ws2 = None if j.w2 is None else split(j.w2, o2, f"{name}.{i}.glu")
            fills += [(j.w, j.mat, ws)] + ([] if ws2 is None else [(j.w2, j.mat, ws2)])
            out.append(dataclasses.replace(j, ws=ws, ws2=ws2))
        return out, fills

    def _prepared(self, j: GemmJob, bk: int, preps: list) -> GemmJob:
        ldx = j.ldx or j.w.n_in
        key = (id(j.x), ldx, j.w.n_in, bk)
        xs = self._xsplits.get(key)
        if xs is None:
            buf = self._act(f"b.xsplit.{len(self._xsplits)}", (kgemm.xsplit_bytes(j.w.n_in, bk, self.rows),), U8)
            xs = self._xsplits[key] = kgemm.XSplit(buf, j.w.n_in, bk, self.rows)
        if all(q is not xs for _, _, q in preps):
            preps.append((j.x, ldx, xs))
        return dataclasses.replace(j, xs=xs)

    def _plan_tile_splits(self, plan: kmoe.TilePlan) -> None:
        """With GEMM_XPREP: the expert GEMMs' split buffers, one per input length (the gate/up's E, the down's Fn),
        shared by the layers (each layer's split is read before the next layer's is written) and sized for either
        k-chunk: the layers' expert types (so their chunks) are known only once the experts are planned."""
        cfg = self.be.cfg
        self._tile_bufs = {}
        if not self.xprep:
            return
        nr = plan.plane_rows
        for n_in in (cfg.n_embd, cfg.n_ff_exp):
            if n_in not in self._tile_bufs:
                size = max(kgemm.xsplit_bytes(n_in, bk, nr) for bk in (64, 128))
                self._tile_bufs[n_in] = self._act(f"b.tile_split.{n_in}", (size,), U8)

    def _tile_splits(self, bank, plan: kmoe.TilePlan):
        """With GEMM_XPREP: the split buffers of a layer's expert GEMMs (moe.py split_plan), else None."""
        if not self._tile_bufs:
            return None
        return tuple(kgemm.XSplit(self._tile_bufs[n_in], n_in, bk, nr)
                     for n_in, bk, nr in kmoe.split_plan(self.be.cfg, bank, plan))

    def _plan_ops(self) -> dict:
        """Per stage, the ops of begin, pre[l], post[l] and head: ('gemm', ...) or ('k', builder(rows))."""
        be, cfg, K = self.be, self.be.cfg, self.be.kern
        E, hc, eps, r = cfg.n_embd, cfg.hc, cfg.rms_eps, cfg.hc_rank
        step = be.b_step
        n_T = step.view("T", 4 * 3, (1,), I32)          # STEP_T
        n_L = step.view("L", 4 * 4, (1,), I32)          # STEP_L
        self.n_T, self.n_L = n_T, n_L
        self.lrows = step.view("logit_rows", 4 * (8 + self.rows), (self.rows,), I32)
        hcE = hc * E

        def k(fn_builder):
            return ("k", fn_builder)

        def read(p, d, half, out, inj):
            """gr_read of T rows: down + inject GEMM on xn, silu, the up GEMM, the gated mean."""
            return [self._gemm(p + f"{half}_down_inject", [GemmJob(d[f"hc_{half}_down"], self.xn, self.lo_raw, ldx=hcE),
                                                          GemmJob(d[f"hc_{half}_inject"], self.xn, inj, ldx=hcE)]),
                    k(lambda rows: khc.lo_act_launch(K.fn("hc", "hc_lo_act"), p + f"{half}_lo", self.lo_raw, self.lo,
                                                     rows, r, hc)),
                    self._gemm(p + f"{half}_up", [GemmJob(d[f"hc_{half}_up"], self.lo, self.G)]),
                    k(lambda rows: khc.mix_launch(K.fn("hc", "hc_mix"), p + f"{half}_mix", self.G, self.xn, out, n_T,
                                                  rows, hc, E))]

        L0 = be.L[0]
        first_norm = None if 0 in cfg.ple_layers else L0["hc_attn_norm"]
        ops = {"begin": [("embed", [k(lambda rows: kgemv.host_copy_launch(K.fn("gemv", "host_copy"), "b.step", step,
                                                                          be.h_step.dptr, step.nbytes)),
                                    k(lambda rows: kgemv.embed_launch(K.fn("gemv", "embed_rms"), "b.embed", be.w_embd,
                                                                       step, self.R, first_norm, self.xn, hc, eps,
                                                                       rows))])]}
        pre, pre_tok, post = [], [], []
        for il in range(cfg.n_layer):
            d, s, p = be.L[il], be.S[il], f"b.blk.{il}."
            st: list = []
            if il in cfg.ple_layers:
                st.append(("ple", [
                    k(lambda rows: CopyH2D("PLE rows", self.ple_e, be.h_ple.ptr, 4 * rows * cfg.ple_dim)),
                    self._gemm(p + "ple_proj", [GemmJob(d["ple_key"], self.ple_e, self.ple_key),
                                                GemmJob(d["ple_value"], self.ple_e, self.ple_value)]),
                    k(lambda rows, d=d, p=p: kple.ple_launches(
                        lambda n: K.fn("ple", n), p + "ple", cfg, self.R, self.ple_key, self.ple_value, self.ple_gate,
                        d["ple_norm_key"], d["ple_norm_query"], d["ple_norm_conv"], d["ple_conv1d"], be.b_ple_hist,
                        step, rows)),
                    k(lambda rows, d=d, p=p: khc.rms_group_launch(K.fn("hc", "rms_group"), p + "attn_norm", self.R,
                                                                  d["hc_attn_norm"], self.xn, hc, E, eps, rows))]))
            st.append(("attn_read", read(p, d, "attn", self.mixed, self.inj_a)))
            if cfg.recurrent[il]:
                mixer = [*self._gemms(p + "gdn_proj", [GemmJob(d["attn_qkv"], self.mixed, self.qkv),
                                                       GemmJob(d["attn_gate"], self.mixed, self.z),
                                                       GemmJob(d["ssm_alpha"], self.mixed, self.alpha),
                                                       GemmJob(d["ssm_beta"], self.mixed, self.beta)]),
                         k(lambda rows, d=d, s=s, p=p: kgdn.gdn_conv_launch(
                             K.fn("gdn", "gdn_conv"), p + "gdn_conv", cfg, self.qkv, d["ssm_conv1d"], s["ring"],
                             self.conv, step, rows)),
                         k(lambda rows, d=d, s=s, p=p: kgdn.gdn_prep_launch(
                             K.fn("gdn", "gdn_prep"), p + "gdn_prep", cfg, self.conv, self.qkv, self.alpha,
                             self.beta, d["ssm_dt"], d["ssm_a"], self.qn, self.kn, self.bt, self.eg, s["ring"], step,
                             rows)),
                         k(lambda rows, s=s, p=p: kgdn.gdn_scan_launch(
                             K.fn("gdn", "gdn_scan"), p + "gdn_scan", cfg, self.qn, self.kn, self.conv, self.bt,
                             self.eg, s["S"], self.o, step, rows)),
                         k(lambda rows, d=d, p=p: kgdn.gdn_out_launch(
                             K.fn("gdn", "gdn_out"), p + "gdn_out", cfg, self.o, self.z, d["ssm_norm"], self.y, step,
                             rows)),
                         self._gemm(p + "ssm_out", [GemmJob(d["ssm_out"], self.y, self.mix_out)])]
            else:
                ld = self.ld_blocks
                mixer = [*self._gemms(p + "qsa_proj", [GemmJob(d["attn_q"], self.mixed, self.qg),
                                                       GemmJob(d["attn_k"], self.mixed, self.kr),
                                                       GemmJob(d["attn_v"], self.mixed, self.vr),
                                                       GemmJob(d["indexer_q_proj"], self.mixed, self.iqr),
                                                       GemmJob(d["indexer_k_proj"], self.mixed, self.ikr)]),
                         k(lambda rows, il=il, d=d, s=s, p=p: kqsa.prep_launch(
                             K.fn("qsa", "qsa_prep"), p + "qsa_prep", cfg, il, self.qg, self.kr, self.vr, self.iqr,
                             self.ikr, d["attn_q_norm"], d["attn_k_norm"], d["indexer_q_norm"], d["indexer_k_norm"],
                             be.inv_freq, self.q, s["Kc"], s["Vc"], self.iq, s["idx_raw"], s["idx_blk"], step,
                             be.max_ctx, rows)),
                         k(lambda rows, il=il, d=d, s=s, p=p: kqsa.pool_launch(
                             K.fn("qsa", "qsa_pool"), p + "qsa_pool", cfg, il, s["idx_raw"], s["idx_blk"],
                             d["indexer_k_norm"], be.inv_freq, step, be.max_ctx, rows)),
                         k(lambda rows, il=il, s=s, p=p: kqsa.score_launch(
                             K.fn("qsa", "qsa_score"), p + "qsa_score", cfg, il, self.iq, s["idx_blk"], self.scores,
                             step, be.max_ctx, be.dev.n_sm, rows, ld)),
                         k(lambda rows, il=il, p=p: kqsa.select_launch(
                             K.fn("qsa", "qsa_select"), p + "qsa_select", cfg, il, self.scores, self.sel, self.meta,
                             step, be.max_ctx, rows, ld)),
                         k(lambda rows, il=il, s=s, p=p: kqsa.attn_launch(
                             lambda n: K.fn("qsa", n), p + "qsa_attn", cfg, il, self.q, s["Kc"], s["Vc"], self.sel,
                             self.meta, self.part, step, be.max_ctx, NSPLIT, rows, ld, tc=True)),
                         k(lambda rows, p=p: kqsa.combine_launch(
                             K.fn("qsa", "qsa_combine"), p + "qsa_combine", cfg, self.part, self.qg, self.att,
                             NSPLIT, step, rows)),
                         self._gemm(p + "attn_output", [GemmJob(d["attn_output"], self.att, self.mix_out)])]
            st.append(("mixer", mixer))
            st.append(("attn_write", [k(lambda rows, d=d, p=p: khc.write_rms_launch(
                K.fn("hc", "write_rms"), p + "attn_write", self.R, self.inj_a, self.mix_out, d["hc_ffn_norm"],
                self.xn, hc, E, eps, rows))]))
            st.append(("ffn_read", read(p, d, "ffn", self.x_ffn, self.inj_f)))
            router = self._gemm(p + "router", [GemmJob(d["router"], self.x_ffn, self.logits_r),
                                               GemmJob(d["shexp_gate"], self.x_ffn, self.sg),
                                               GemmJob(d["ffn_gate_shexp"], self.x_ffn, self.h_sh,
                                                       w2=d["ffn_up_shexp"])])
            def route(ring: bool, il=il, p=p):
                return k(lambda rows: kmoe.route_launch(
                    K.fn("moe", "moe_route"), p + "route", cfg, il, self.logits_r, self.x_ffn, self.ids, self.wts,
                    step, be.db.ptrs if ring else None, self.ticket, rows))
            shared = ("shared", [self._gemm(p + "shexp_down", [GemmJob(d["ffn_down_shexp"], self.h_sh, self.shared)])])
            pre.append(st + [("route", [router, route(True)]), shared])
            pre_tok.append(st + [("route", [router, route(False)]), shared])   # the whole-step graph: no doorbell
            w_next = be.L[il + 1]["hc_attn_norm"] if il + 1 < cfg.n_layer else be.w_out_norm
            slot_of = self.slot_of if be.experts == "host" else None
            host_parts = self.host_parts if be.experts == "host" else self.out_exp
            tp = self.tile_plan
            post.append([
                ("experts", [
                    k(lambda rows, p=p, slot_of=slot_of: kmoe.group_launch(
                        K.fn("moe", "moe_group"), p + "group", cfg, self.ids, slot_of, step, self.pair_tok,
                        self.pair_of, self.tiles, self.n_tiles, self.rows, tp)),
                    k(lambda rows, il=il, p=p: kmoe.grouped_launches(
                        lambda n: K.fn("moe", n), p + "experts", cfg, be.expert_job[il], be.banks[il], self.tiles,
                        self.n_tiles, self.x_ffn, self.pair_tok, self.h_exp, self.out_exp, rows, tp,
                        self._tile_splits(be.banks[il], tp), be.dev.arch))]),
                ("combine", [k(lambda rows, p=p, w_next=w_next, host_parts=host_parts: kmoe.combine_rows_launch(
                    K.fn("moe", "combine_rows"), p + "combine", cfg, self.wts, self.pair_of, self.out_exp,
                    host_parts, self.shared, self.sg, self.inj_f, self.R, self.comb, w_next, self.xn, step,
                    rows))])])
        L = self.logit_rows
        head = [k(lambda rows: kgemv.gather_launch(K.fn("gemv", "gather_rows"), "b.head_gather", self.xn, self.xh,
                                                   self.lrows, n_L, L, hcE)),
                self._gemm("b.output_down", [GemmJob(be.w_out_down, self.xh, self.lo_h, ldx=hcE)], n_L),
                k(lambda rows: khc.lo_act_launch(K.fn("hc", "hc_lo_act"), "b.output_lo", self.lo_h, self.lo_ha, L, r,
                                                 hc)),
                self._gemm("b.output_up", [GemmJob(be.w_out_up, self.lo_ha, self.G_h)], n_L),
                k(lambda rows: khc.mix_launch(K.fn("hc", "hc_mix"), "b.output_mix", self.G_h, self.xh, self.mixed_h,
                                              n_L, L, hc, E)),
                self._gemm("b.lm_head", [GemmJob(be.w_out, self.mixed_h, self.logits)], n_L)]
        ops["pre"], ops["pre_tok"], ops["post"], ops["head"] = pre, pre_tok, post, [("head", head)]
        return ops

    # ---- after the commit ---------------------------------------------------------------------------------
    def build(self) -> None:
        """Every bucket's launches; the GEMM job tables' contents (the same for every bucket)."""
        K = self.be.kern

        def one(op, rows):
            if op[0] == "k":
                got = op[1](rows)
                return list(got) if isinstance(got, tuple) else [got]
            _, name, table, jobs, n_rows, preps, wplan = op
            n_rows = n_rows or self.n_T
            fn = lambda n: K.fn("gemm", n)
            xsplits = [kgemm.xsplit_launch(fn, f"{name}.x_split{i}", x, ldx, xs, n_rows, rows)
                       for i, (x, ldx, xs) in enumerate(preps)]
            ks = kgemm.k_slices(jobs, rows, self.be.dev.n_sm)
            part = self.ksplit_buf if ks > 1 else None
            if wplan is None or rows < kgemm.WPREP_MIN_ROWS:
                tab, fills, swz = table, [], 0
            else:
                jobs, fills = self._wsplits(name, jobs, wplan)
                tab, swz = wplan[0], kgemm.WPREP_GROUP
            return [*xsplits, *(kgemm.wsplit_launch(fn, f"{name}.w_split{i}", w, mat, ws)
                                for i, (w, mat, ws) in enumerate(fills)),
                    kgemm.gemm_launch(fn, name, tab, jobs, n_rows, rows, swz=swz, ks=ks, part=part,
                                      arch=self.be.dev.arch),
                    *([kgemm.ksum_launch(K.fn("gemm", "gemm_ksum"), name + ".ksum", tab, jobs, n_rows, rows, ks,
                                         part)] if ks > 1 else [])]

        def stages(st, rows):
            return [(name, [x for op in ops for x in one(op, rows)]) for name, ops in st]

        self.launches = {}
        for b in self.buckets:
            self.launches[b] = {"begin": stages(self._ops["begin"], b),
                                "pre": [stages(x, b) for x in self._ops["pre"]],
                                "post": [stages(x, b) for x in self._ops["post"]]}
            if self.be.experts == "vram":
                self.launches[b]["pre_tok"] = [stages(x, b) for x in self._ops["pre_tok"]]
        self.head = stages(self._ops["head"], self.logit_rows)

    def capture(self) -> None:
        be = self.be
        self.g: dict = {}
        for b in self.buckets:
            ls = self.launches[b]
            self.g[("begin", b)] = Graph(f"b{b}.begin", be.stream, lambda ls=ls: self._enq(ls["begin"]))
            for il in range(be.cfg.n_layer):
                self.g[("pre", b, il)] = Graph(f"b{b}.pre[{il}]", be.stream, lambda ls=ls, il=il: self._enq(ls["pre"][il]))
                self.g[("post", b, il)] = Graph(f"b{b}.post[{il}]", be.stream,
                                                lambda ls=ls, il=il: self._enq(ls["post"][il]))
            if be.experts == "vram":
                def whole(ls=ls):
                    self._enq(ls["begin"])
                    for il in range(be.cfg.n_layer):
                        self._enq(ls["pre_tok"][il])
                        self._enq(ls["post"][il])
                self.g[("whole", b)] = Graph(f"b{b}.whole", be.stream, whole)

    def destroy(self) -> None:
        for g in getattr(self, "g", {}).values():
            g.destroy()
        self.g = {}

    def _enq(self, stages) -> None:
        for _, launches in stages:
            for launch in launches:
                launch.enqueue(self.be.stream)

    def bucket(self, T: int) -> int:
        for b in self.buckets:
            if T <= b:
                return b
        raise ValueError(f"a step of {T} rows; at most {self.rows}")

    def run(self, key, b: int, il: int | None = None) -> None:
        be = self.be
        if be.graphs:
            self.g[(key, b) if il is None else (key, b, il)].launch(be.stream)
        else:
            ls = self.launches[b][key]
            self._enq(ls if il is None else ls[il])

    def timed(self, b: int, per_launch: bool = False) -> list[tuple[str, float]]:
        """The staged step through bucket b's launches stage by stage with an event between stages (eager, no
        doorbell): [(label, ms)] summing to the run's total, labels 'begin', 'gdn:mixer', 'qsa:experts', 'head';
        per_launch: an event after every launch instead, labels 'gdn:mixer:gdn_proj' (the stage, then the launch's
        name without its layer). Synchronizes: measurement only."""
        be, ls = self.be, self.launches[b]
        pre = ls.get("pre_tok", ls["pre"])
        parts = [("begin", ls["begin"])]
        for il in range(be.cfg.n_layer):
            kind = "gdn" if be.cfg.recurrent[il] else "qsa"
            for name, x in pre[il] + ls["post"][il]:
                if per_launch:                          # labels without the layer: summed over the layers
                    parts += [(f"{kind}:{name}:{re.sub(r'^b[.]blk[.][0-9]+[.]', '', ln.name)}", [(name, [ln])])
                              for ln in x]
                else:
                    parts.append((f"{kind}:{name}", [(name, x)]))
        parts.append(("head", self.head))
        evs = [drv.Event(timing=True) for _ in range(len(parts) + 1)]
        try:
            evs[0].record(be.stream)
            for (_, st), ev in zip(parts, evs[1:]):
                self._enq(st)
                ev.record(be.stream)
            evs[-1].synchronize("timed step")
            return [(label, evs[i + 1].elapsed_ms(evs[i])) for i, (label, _) in enumerate(parts)]
        finally:
            for ev in evs:
                ev.destroy()

    def run_head(self) -> None:
        self._enq(self.head)

    def host_buffers(self) -> None:
        """Pinned staging: the logit rows; in host mode the layers' slot tables (one row a layer, mapped: a kernel
        copies a layer's row when its post is enqueued, and the host may write the next layer's meanwhile) and the
        host's parts."""
        cfg, k, E = self.be.cfg, self.be.cfg.n_expert_used, self.be.cfg.n_embd
        self.h_logits = drv.HostBuffer(4 * self.logit_rows * cfg.n_vocab, what="batched logits")
        self.logits_out = self.h_logits.array(F32, (self.logit_rows, cfg.n_vocab))
        self._pinned = [self.h_logits]
        if self.be.experts == "host":
            self.h_slot = drv.HostBuffer(4 * cfg.n_layer * cfg.n_expert, mapped=True, what="slot table staging")
            self.slot_stage = self.h_slot.array(I32, (cfg.n_layer, cfg.n_expert))
            self._slot_copy: dict[int, object] = {}          # layer -> its row's host_copy launch
            # a streamed step's routes, each layer's copied back beside its post (read after the step)
            self.h_routes = drv.HostBuffer(4 * cfg.n_layer * self.rows * k, what="streamed routes")
            self.routes_stage = self.h_routes.array(np.int32, (cfg.n_layer, self.rows, k))
            self.h_parts = drv.HostBuffer(4 * self.rows * k * E, what="host parts staging")
            self.parts_stage = self.h_parts.array(F32, (self.rows, k, E))
            self._pinned += [self.h_slot, self.h_parts, self.h_routes]

    def free_host(self) -> None:
        for b in getattr(self, "_pinned", []):
            b.free()
        self._pinned = []

    def stage_post(self, layer: int, slot_of: np.ndarray, parts: np.ndarray | None = None,
                   mask: np.ndarray | None = None) -> None:
        """Host mode: the layer's slot table, and the host's parts (T, k, E) where mask (T, k) is false, copied
        before post[layer] (parts None: the device computes every routed expert)."""
        be = self.be
        self.slot_stage[layer] = slot_of
        if layer not in self._slot_copy:
            rb = self.slot_stage[0].nbytes
            self._slot_copy[layer] = kgemv.host_copy_launch(be.kern.fn("gemv", "host_copy"),
                                                            f"post[{layer}] slot table", self.slot_of,
                                                            self.h_slot.dptr + rb * layer, rb)
        self._slot_copy[layer].enqueue(be.stream)
        if parts is not None and not mask.all():
            T, k, E = parts.shape
            self.parts_stage[:T][~mask] = parts[~mask]
            drv.memcpy_htod_async(self.host_parts.ptr, self.h_parts.ptr, 4 * T * k * E, be.stream,
                                  "post[%d] host parts", layer)

    def copy_routes(self, layer: int) -> None:
        """The step's routed experts of `layer` (written by its pre's router) back to pinned memory, in stream order
        before the next pre overwrites them."""
        k = self.be.cfg.n_expert_used
        drv.memcpy_dtoh_async(self.h_routes.ptr + layer * self.rows * k * 4, self.ids.ptr, 4 * self.be.cur.T * k,
                              self.be.stream, "layer %d routes", layer)

    def copy_logits(self, n: int) -> None:
        drv.memcpy_dtoh_async(self.h_logits.ptr, self.logits.ptr, 4 * n * self.be.cfg.n_vocab, self.be.stream,
                              "batched logits")
