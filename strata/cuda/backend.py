"""CudaBackend: the Backend protocol (strata.host.backend) on one NVIDIA GPU.

Per layer two captured graphs, with the stage names of strata.reference.model:
    pre[l]   [ple] -> attn_read -> mixer -> attn_write -> ffn_read -> route (rings the doorbell) -> shared expert
    post[l]  experts (the VRAM-resident routed ones) -> combine (+ the host's parts, gr_write, the next read's norm)
and a begin graph (the step words from pinned staging, the embedding row, layer 0's read norm; the PLE vector is
copied from its staging inside pre[PLE layer], so the host may stage it late: stage_ple), a head graph (final mixer, LM head, logits to pinned memory). With every expert in VRAM a whole-token graph chains
them all with no host round trip (launch_whole). With max_step_tokens > 1, a step of several rows of the
sequence (a prompt chunk) runs the batched path of strata.cuda.batch through the same protocol.

Everything the graphs touch lives in one arena at fixed addresses; what changes per token (token id, position,
the doorbell's ring value) is the step block copied from pinned staging inside the begin graph, and what
changes per layer (which experts the host computed, their outputs, the cache slots of the resident ones) is
copied from pinned staging before post[l] launches. Kernel arguments never change after capture.

The host never blocks inside the layer loop: poll_route reads the doorbell's mapped sequence word and queries
an event; poll_logits queries one. A post is never waited for: the next launch follows it on the stream. One
sequence at a time (new_seq refuses a second live one); a step of one row runs the one-token kernels here (GEMVs),
a step of more rows the batched path (GEMMs, strata.cuda.batch).

Numerics: the f32 path (quant.cuh): weights dequantized in registers, activations and accumulation float32,
KV cache float32. Every kernel is deterministic (fixed reduction orders, no float atomics), so a replayed graph
gives the eager launch sequence's bits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial, wraps

import numpy as np

from strata.config import ModelConfig
from strata.cuda import driver as drv
from strata.cuda.arena import Arena, DevArray, DevMat
from strata.cuda.batch import BatchPath
from strata.cuda.doorbell import Doorbell
from strata.cuda.driver import CudaError
from strata.cuda.graphs import Graph
from strata.cuda.launch import CopyH2D, Launch, pdl_status
from strata.cuda.weights import Uploader, conversion_note, device_rows, device_type
from strata.host.backend import MAPPED_READS, PREFETCH_EXTRA_MAX, BackendError, BudgetTooSmall, ExpertPlan, Route, Step
from strata.host.cells import Cells
from strata.kernels import Kernels
from strata.kernels import gdn as kgdn
from strata.kernels import gemv as kgemv
from strata.kernels import hc as khc
from strata.kernels import moe as kmoe
from strata.kernels import ple as kple
from strata.kernels import qsa as kqsa
from strata.kernels.gemv import Job, device_row_bytes
from strata.model.loader import Model
from strata.quant.formats import QType, row_bytes
from strata.reference.common import rope_inv_freq
from strata.reference.model import StageDump

F32, I32, U8 = np.float32, np.int32, np.uint8
STEP_TOKEN, STEP_POS, STEP_RING, STEP_T, STEP_L, STEP_FLAGS, STEP_WORDS = 0, 1, 2, 3, 4, 5, 8    # common.cuh
STEP_ROUTE_X = 1                 # STEP_FLAGS: the doorbell carries the routed rows of x
POST_PARTS_OFFSET = 256                          # post_in: slots (k i32) at 0, host parts (k, E) f32 here
# device memory left free beside the arena for the driver, the graphs and what the context takes once tokens run:
# on the H200 the device's use grew 0.66 GiB after setup during a 24 GiB budget bench (23.51 -> 24.17 GiB with
# 512 MiB here); with 1280 MiB it peaked at 23.42 GiB (bench/RESULTS.md, issue 6)
MEM_MARGIN = 1280 << 20
LOAD_STAGING = 4                                 # pinned buffers for load_expert copies in flight
# CTAs of a prefetch fetch (mapped_reads="prefetch"): it runs beside a layer's compute, so it takes few
# multiprocessors; 16 CTAs keep 16 x 256 x 8 16-byte reads (512 KB) in flight, more than PCIe needs
PREFETCH_CTAS = 16
COPY_WHAT = "expert %d.%d -> slot %d"            # an expert copy, in an error's message
LOAD_EVENTS = 64                                 # posts whose expert loads may be in flight


class _Later:
    """A launch built after the arena is committed (its arguments are addresses); built once, shared by the
    graphs that run it (pre[l] and the whole-token graph)."""

    def __init__(self, fn, *args):
        self.fn, self.args, self.value = fn, args, None    # fn(*args) -> a Launch, a CopyH2D or a tuple of them

    def __call__(self):
        if self.value is None:
            self.value = self.fn(*self.args)
        return self.value


@dataclass
class _Seq:
    dump: StageDump | None
    pos: int = 0
    phase: str = "idle"          # idle | begun | pre | routed | post | head
    layer: int = -1
    route: Route | None = None
    mask: np.ndarray | None = None
    parts: np.ndarray | None = None
    t_pre: float = 0.0
    ple_ready: bool = False      # this token's PLE vector is in pinned staging (begin or stage_ple)
    live: bool = True


def as_is_shapes(types: tuple[int, int, int], E: int, Fn: int) -> tuple | None:
    """A layer's expert gate, up and down slices' (rows, row bytes) where the kernels take its file types as they
    are (no conversion, no padding); None where a slice must be converted (device_rows)."""
    dims = ((Fn, E), (Fn, E), (E, Fn))
    if not all(device_type(t) == QType(t) and row_bytes(t, n_in) == device_row_bytes(t, n_in)
               for t, (_, n_in) in zip(types, dims)):
        return None
    return tuple((rows, device_row_bytes(t, n_in)) for t, (rows, n_in) in zip(types, dims))


def _guarded(method):
    """Any failure of a call marks the device failed; later calls say so instead of touching it again."""
    @wraps(method)
    def call(self, *args, **kwargs):
        if self._failed is not None:
            raise BackendError(f"{method.__name__}: the device failed earlier: {self._failed}")
        try:
            return method(self, *args, **kwargs)
        except CudaError as e:
            self._failed = str(e)
            raise
    return call


class CudaBackend:
    name = "cuda"
    max_seqs = 1          # one sequence at a time on the GPU: the state buffers exist once

    def __init__(self, model: Model, *, vram_budget_bytes: int | None = None, max_ctx: int = 8192,
                 experts: str = "vram", graphs: bool = True, doorbell_timeout_s: float = 30.0,
                 budget_counts_device: bool = False, step_tokens: int = 1, mapped_reads: str = "prefetch",
                 prefetch_extra: int = 0, log=print):
        """experts="vram": every routed expert uploaded, resident() all true, a whole-token graph.
        experts="host": no expert is resident until load_expert puts it in one of expert_slots() cache slots,
        as many as vram_budget_bytes leaves room for (no budget: none, every expert is the host's).
        budget_counts_device: vram_budget_bytes bounds the device memory in use, not only the arena: what the
        device already holds when the arena is planned (this CUDA context, the kernels' modules, and anything
        else on the GPU) and MEM_MARGIN for the graphs come off it first. The engine passes True (a "24 GiB"
        budget means a 24 GiB card); the tests size arenas exactly and pass False.
        step_tokens: the most rows a step may carry (max_step_tokens); above 1 the batched path's buffers and
        graphs are planned for it.
        mapped_reads: how a mapped token's expert kernels get the experts it misses in VRAM: "fetch", a kernel of
        every SM copies each layer's misses into VRAM staging first (moe.cu moe_fetch); "prefetch", the same, and
        beside each layer's compute, on a second graph branch, the next layer's router applied to this layer's MoE
        input predicts its experts and the predicted misses are fetched into another staging, which the next
        layer's fetch takes instead of copying them again (a wrong guess costs PCIe bytes, never correctness);
        "direct", the expert kernels read them over PCIe themselves.
        prefetch_extra: with "prefetch", the prediction keeps that many experts more than the model's top k (the
        predicted logits' top k + extra: more of the misses predicted, for PCIe bytes beside the compute)."""
        if experts not in ("vram", "host"):
            raise BackendError(f"CudaBackend: experts={experts!r}: 'vram' or 'host'")
        if mapped_reads not in MAPPED_READS:
            raise BackendError(f"CudaBackend: mapped_reads={mapped_reads!r}: one of {', '.join(MAPPED_READS)}")
        self.mapped_reads = mapped_reads
        self.prefetch = mapped_reads == "prefetch"
        if not 0 <= int(prefetch_extra) <= PREFETCH_EXTRA_MAX:
            raise BackendError(f"CudaBackend: prefetch_extra={prefetch_extra}: 0 .. {PREFETCH_EXTRA_MAX}")
        # the experts a prediction keeps (moe_route's warps keep 32 candidates each: at most 32)
        self.k_pred = min(model.cfg.n_expert_used + int(prefetch_extra), model.cfg.n_expert, 32)
        self._failed: str | None = None
        self.cfg: ModelConfig = model.cfg
        self.experts, self.graphs, self.max_ctx, self.timeout = experts, graphs, int(max_ctx), doorbell_timeout_s
        if not 1 <= int(step_tokens) <= self.max_ctx:
            raise BackendError(f"CudaBackend: step_tokens={step_tokens}: 1 .. max_ctx ({self.max_ctx})")
        self.max_step_tokens = int(step_tokens)
        self.log = log
        cfg, W = self.cfg, model.weights
        self.dev = drv.Device.open()
        self.stream, self.side = drv.Stream(), drv.Stream()
        # a whole-token graph's second branch (the shared expert's down projection beside the routed experts)
        self.branch, self.ev_fork, self.ev_join = drv.Stream(), drv.Event(), drv.Event()
        # the whole-token graph runs the shared expert on a branch (_enq_token_layer); False: on the main stream
        # before the router (bench/gpu_check.py's ablate phase compares the two)
        self.shared_on_branch = True
        # ... and the third (mapped_reads="prefetch": the next layer's prediction and prefetch)
        self.branch2, self.ev_fork2, self.ev_pred = drv.Stream(), drv.Event(), drv.Event()
        # one prefetch-done event per layer parity: layer l's fetch must wait for layer l's prefetch, and by then
        # layer l's pre has already forked (and recorded) layer l + 1's
        self.ev_pref = (drv.Event(), drv.Event())
        t0 = time.time()
        self.kern = Kernels(self.dev.arch)
        log(f"strata.cuda: {self.dev.name} (sm_{self.dev.arch}, {self.dev.n_sm} SMs); kernels ready in "
            f"{time.time() - t0:.1f}s; {pdl_status()}")
        self.nsplit = 64
        self.notes: list[str] = []
        self._uploads: list[tuple[DevArray, object]] = []
        self._mats: dict[int, DevMat] = {}
        self.A = Arena()
        self._plan_weights(W)
        self._plan_buffers()
        self.batch = BatchPath(self, self.max_step_tokens) if self.max_step_tokens > 1 else None
        self.db = Doorbell(cfg.n_embd, cfg.n_expert_used, self.max_step_tokens)
        if self.batch is not None:
            self.batch.plan()
        self.held_before = 0
        if budget_counts_device and vram_budget_bytes is not None:
            free, total = self.dev.mem_info()
            self.held_before = total - free
            vram_budget_bytes -= self.held_before + MEM_MARGIN
            log(f"strata.cuda: {self.held_before / 2**30:.2f} GiB in use on the device before the arena "
                f"(+{MEM_MARGIN >> 20} MiB kept for the graphs): the arena may take "
                f"{max(vram_budget_bytes, 0) / 2**30:.2f} GiB of the budget")
        self._plan_experts(W, vram_budget_bytes, self.A.total)
        self._plan_launches()
        free, total = self.dev.mem_info()
        if self.A.total + MEM_MARGIN > free:
            self._drop_streams()
            raise BudgetTooSmall(f"CudaBackend: the arena needs {self.A.total / 2**30:.2f} GiB (+{MEM_MARGIN >> 20} "
                                 f"MiB margin), the device has {free / 2**30:.2f} GiB free of {total / 2**30:.2f}")
        if vram_budget_bytes is not None and self.A.total > vram_budget_bytes:
            held = (f" ({self.held_before / 2**30:.2f} GiB already in use on the device and {MEM_MARGIN >> 20} MiB "
                    f"for the graphs came off it)" if self.held_before else "")
            self._drop_streams()
            raise BudgetTooSmall(f"CudaBackend: the model needs {self.A.total / 2**30:.2f} GiB of VRAM with experts="
                                 f"{experts!r}, the budget leaves {vram_budget_bytes / 2**30:.2f} GiB{held}")
        self.A.commit()
        self.A.zero(self.stream)
        self._upload()
        for n in self.notes:
            log(f"strata.cuda: {n}")
        self._host_buffers()
        self._build_launches()
        self.seq: _Seq | None = None
        self.cur: Step | None = None                     # the step in flight
        self._ring = 1
        self._g: dict = {}
        if graphs:
            self._capture()
        self.stream.synchronize("setup")
        free, total = self.dev.mem_info()
        self.device_in_use = total - free
        log(f"strata.cuda: arena {self.A.total / 2**30:.2f} GiB, device memory in use {self.device_in_use / 2**30:.2f}"
            f" GiB, experts {experts}"
            + (f" ({self.n_slots} cache slots, {self.n_lend} more lent between batched steps: "
               f"{self.n_lend - self.n_lend_act} of the stream buffers, {self.n_lend_act} of the activations)"
               if experts == "host" else "")
            + (f", {sum(g.n_nodes for g in self._g.values())} graph nodes" if graphs else ", eager launches")
            + f"; {pdl_status()}"
            + f", ready in {time.time() - t0:.1f}s")

    # ---- planning: every buffer reserved before the one allocation ----------------------------------------
    def _vec(self, name: str, arr: np.ndarray) -> DevArray:
        arr = np.ascontiguousarray(arr, dtype=F32)
        a = self.A.reserve(name, arr.shape, F32)
        self._uploads.append((a, arr))
        return a

    def _mat(self, name: str, m) -> DevMat:
        """A weight matrix (strata.model.weights.Mat) in its device format; a tied matrix is uploaded once."""
        if id(m) in self._mats:
            return self._mats[id(m)]
        dt = device_type(m.qtype)
        rb = device_row_bytes(dt, m.n_in)
        rows = m.n_mat * m.n_out
        buf = self.A.reserve(name, (rows * rb,), U8)
        self._uploads.append((buf, partial(device_rows, m.raw, m.qtype, rows, m.n_in)))   # converted at upload
        note = conversion_note(name, m.qtype)
        if note:
            self.notes.append(note)
        d = DevMat(buf, int(dt), m.n_out, m.n_in, rb, m.n_mat)
        self._mats[id(m)] = d
        return d

    def _row_mat(self, name: str, v: np.ndarray) -> DevMat:
        """A vector as a one-row F32 matrix (the shared expert's gate), so it joins a GEMV launch."""
        v = np.ascontiguousarray(v, dtype=F32).reshape(1, -1)
        n = v.shape[1]
        rb = device_row_bytes(QType.F32, n)
        buf = self.A.reserve(name, (rb,), U8)
        self._uploads.append((buf, device_rows(v, QType.F32, 1, n)))
        return DevMat(buf, int(QType.F32), 1, n, rb)

    def _plan_weights(self, W) -> None:
        cfg = self.cfg
        self.w_embd = self._mat("token_embd", W.token_embd)
        self.w_out = self._mat("output", W.output)
        self.w_out_norm = self._vec("output_hc_norm", W.output_hc_norm)
        self.w_out_down = self._mat("output_hc_down", W.output_hc_down)
        self.w_out_up = self._mat("output_hc_up", W.output_hc_up)
        self.L: list[dict] = []
        for il, lw in enumerate(W.layers):
            p = f"blk.{il}."
            d: dict = {}
            for half in ("attn", "ffn"):
                d[f"hc_{half}_norm"] = self._vec(p + f"hc_{half}_norm", getattr(lw, f"hc_{half}_norm"))
                for part in ("down", "up", "inject"):
                    key = f"hc_{half}_{part}"
                    d[key] = self._mat(p + key, getattr(lw, key))
            if cfg.recurrent[il]:
                for key in ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out"):
                    d[key] = self._mat(p + key, getattr(lw, key))
                for key in ("ssm_conv1d", "ssm_dt", "ssm_a", "ssm_norm"):
                    d[key] = self._vec(p + key, getattr(lw, key))
            else:
                for key in ("attn_q", "attn_k", "attn_v", "attn_output", "indexer_q_proj", "indexer_k_proj"):
                    d[key] = self._mat(p + key, getattr(lw, key))
                for key in ("attn_q_norm", "attn_k_norm", "indexer_q_norm", "indexer_k_norm"):
                    d[key] = self._vec(p + key, getattr(lw, key))
            if il in cfg.ple_layers:
                for key in ("ple_key", "ple_value"):
                    d[key] = self._mat(p + key, getattr(lw, key))
                for key in ("ple_norm_key", "ple_norm_query", "ple_norm_conv", "ple_conv1d"):
                    d[key] = self._vec(p + key, getattr(lw, key))
            d["router"] = self._mat(p + "ffn_gate_inp", lw.ffn_gate_inp)
            d["shexp_gate"] = self._row_mat(p + "ffn_gate_inp_shexp", lw.ffn_gate_inp_shexp)
            for key in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"):
                d[key] = self._mat(p + key, getattr(lw, key))
            self.L.append(d)
        self.inv_freq = self._vec("rope_inv_freq", rope_inv_freq(cfg.n_rot, cfg.rope_base))

    def _plan_buffers(self) -> None:
        """Activations (reused by every layer) and the sequence state. Layouts are row-major, f32 unless noted."""
        cfg, R = self.cfg, self.A.reserve
        E, hc, k = cfg.n_embd, cfg.hc, cfg.n_expert_used
        # STEP_* words, then the rows' token ids and the logit rows: from pinned staging per step
        self.b_step = R("step", (STEP_WORDS + 2 * self.max_step_tokens,), I32)
        self.b_ticket = R("route_ticket", (1,), np.uint32)  # moe_route's last-row ticket (left zeroed)
        self.b_R = R("R", (hc, E))                          # the residual streams
        self.b_xn = R("xn", (hc, E))                        # the current read's normalized streams
        self.b_lo = R("lo", (cfg.hc_rank,))                 # gr_read's low-rank pre-activation
        self.b_inj_a = R("inject_attn", (hc,))              # raw inject logits of the attention half
        self.b_inj_f = R("inject_ffn", (hc,))               # ... and of the ffn half (read by post)
        self.b_mixed = R("mixed", (E,))                     # attention read: the mixer's input
        self.b_mix_out = R("mixer_out", (E,))
        self.b_x_ffn = R("x_ffn", (E,))                     # ffn read: the MoE input
        self.b_logits_r = R("router_logits", (cfg.n_expert,))
        self.b_sg = R("shexp_gate", (1,))                   # shared expert gate logit
        self.b_ids = R("ids", (k,), I32)                    # routed experts (the vram mode's slots)
        self.b_wts = R("weights", (k,))
        self.b_h_sh = R("h_shared", (cfg.n_ff_shexp,))
        self.b_shared = R("shared", (E,))
        self.b_h_exp = R("h_experts", (k, kmoe.padded_ff(cfg)))
        self.b_gpu_parts = R("gpu_parts", (k, E))
        self.b_post_in = R("post_in", (POST_PARTS_OFFSET + 4 * k * E,), U8)   # copied from pinned staging
        self.b_slots = self.b_post_in.view("slots", 0, (k,), I32)
        self.b_host_parts = self.b_post_in.view("host_parts", POST_PARTS_OFFSET, (k, E), F32)
        self.b_comb = R("combine", (E,))
        self.b_logits = R("logits", (cfg.n_vocab,))
        self.state: list[DevArray] = []                     # zeroed by new_seq
        self.S: dict[int, dict] = {}
        if any(cfg.recurrent):
            self.b_qkv = R("gdn_qkv", (cfg.conv_dim,))
            self.b_z = R("gdn_z", (cfg.value_dim,))
            self.b_alpha = R("gdn_alpha", (cfg.ssm_v_heads,))
            self.b_beta = R("gdn_beta", (cfg.ssm_v_heads,))
            self.b_y = R("gdn_y", (cfg.value_dim,))
        if not all(cfg.recurrent):
            kqsa.check_geometry(cfg)
            H, Hkv, D, Hi, Di = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.idx_heads, cfg.idx_dim
            max_blocks = max(self.max_ctx // cfg.compress_ratios[i] for i in range(cfg.n_layer) if not cfg.recurrent[i])
            self.b_qg = R("qsa_q_gate", (H, 2 * D))
            self.b_kr = R("qsa_k", (Hkv * D,))
            self.b_vr = R("qsa_v", (Hkv * D,))
            self.b_iqr = R("qsa_iq_raw", (Hi * Di,))
            self.b_ikr = R("qsa_ik_raw", (Di,))
            self.b_q = R("qsa_q", (H, D))
            self.b_iq = R("qsa_iq", (Hi, Di))
            self.b_scores = R("qsa_scores", (max_blocks,))
            self.b_sel = R("qsa_sel", (max_blocks,), I32)
            self.b_meta = R("qsa_meta", (2,), I32)           # n selected blocks, n cells
            self.b_part = R("qsa_partials", (H, self.nsplit, D + 2))
            self.b_att = R("qsa_att", (H * D,))
        if cfg.ple_layers:
            self.b_ple_e = R("ple_e", (cfg.ple_dim,))          # the host's gathered rows, from pinned staging
            self.b_ple_key = R("ple_key_raw", (cfg.hc_dim,))
            self.b_ple_value = R("ple_value", (E,))
            self.b_ple_gate = R("ple_gate", (cfg.hc,))
            self.b_ple_hist = R("ple_hist", (cfg.ple_hist, cfg.hc_dim))
            self.state.append(self.b_ple_hist)
        for il in range(cfg.n_layer):
            s: dict = {}
            if cfg.recurrent[il]:
                s["ring"] = R(f"blk.{il}.conv_ring", (cfg.ssm_conv, cfg.conv_dim))
                s["S"] = R(f"blk.{il}.ssm_state", (cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_state))
                self.state += [s["ring"], s["S"]]
            else:
                Hkv, D, Di, ratio = cfg.n_head_kv, cfg.head_dim, cfg.idx_dim, cfg.compress_ratios[il]
                s["Kc"] = R(f"blk.{il}.k_cache", (self.max_ctx, Hkv, D))
                s["Vc"] = R(f"blk.{il}.v_cache", (self.max_ctx, Hkv, D))
                s["idx_raw"] = R(f"blk.{il}.indexer_raw_keys", (self.max_ctx, Di))
                s["idx_blk"] = R(f"blk.{il}.indexer_block_keys", (self.max_ctx // ratio, Di))
            self.S[il] = s

    @staticmethod
    def _file_types(lw) -> tuple[int, int, int]:
        """The file's types of a layer's expert gate, up and down matrices."""
        if lw.ffn_gate_up_exps is not None:
            return lw.ffn_gate_up_exps.qtype, lw.ffn_gate_up_exps.qtype, lw.ffn_down_exps.qtype
        return lw.ffn_gate_exps.qtype, lw.ffn_up_exps.qtype, lw.ffn_down_exps.qtype

    def _plan_experts(self, W, budget: int | None, fixed: int) -> None:
        cfg = self.cfg
        E, Fn = cfg.n_embd, cfg.n_ff_exp
        self.banks: list[kmoe.ExpertBank] = []
        self.expert_job = [self.A.reserve(f"blk.{il}.moe_job", (kmoe.MOE_JOB_DTYPE.itemsize,), U8)
                           for il in range(cfg.n_layer)]
        self._taken: np.ndarray | None = None   # the lent slots the batched step in flight took back (take_lent)
        act = self.batch.act if self.batch is not None else None
        if self.experts == "vram":
            self.n_slots = self.n_stream = self.n_lend = self.n_lend_act = 0
            if act is not None:
                self.A.place(act, self.A.reserve("batch_activations", (max(act.total, 1),), U8), 0)
            self.can_map = False
            for il, lw in enumerate(W.layers):
                p = f"blk.{il}."
                down = self._mat(p + "ffn_down_exps", lw.ffn_down_exps)
                if lw.ffn_gate_up_exps is not None:
                    gu = self._mat(p + "ffn_gate_up_exps", lw.ffn_gate_up_exps)
                    half = DevMat(gu.buf, gu.qtype, Fn, E, gu.row_bytes, gu.n_mat)
                    self.banks.append(kmoe.ExpertBank(half, 0, half, Fn * gu.row_bytes, down, 0,
                                                      (gu.mat_bytes, gu.mat_bytes, down.mat_bytes)))
                else:
                    g = self._mat(p + "ffn_gate_exps", lw.ffn_gate_exps)
                    u = self._mat(p + "ffn_up_exps", lw.ffn_up_exps)
                    self.banks.append(kmoe.ExpertBank(g, 0, u, 0, down, 0, (g.mat_bytes, u.mat_bytes, down.mat_bytes)))
            return
        # the cache: n_slots slots of [gate | up | down], each part 256-aligned, sized for the widest layer
        self.file_types = [self._file_types(lw) for lw in W.layers]
        types = [tuple(device_type(t) for t in ft) for ft in self.file_types]
        self._as_is = [as_is_shapes(ft, E, Fn) for ft in self.file_types]
        for il, ft in enumerate(self.file_types):
            for t, what in zip(ft, ("gate", "up", "down")):
                note = conversion_note(f"blk.{il}.ffn_{what}_exps (each load_expert)", t)
                if note:
                    self.notes.append(note)
        al = lambda n: (n + 255) // 256 * 256
        self.slot_parts = (max(al(Fn * device_row_bytes(t[0], E)) for t in types),
                           max(al(Fn * device_row_bytes(t[1], E)) for t in types),
                           max(al(E * device_row_bytes(t[2], Fn)) for t in types))
        self.slot_bytes = sum(self.slot_parts)
        act_bytes = 0 if act is None else act.total      # placed after the slots, in the same buffer (below)
        room = 0 if budget is None else budget - fixed - act_bytes - (1 << 20)  # 1 MiB: the job tables planned next
        # a mapped token (map_experts): one graph whose one-row expert kernels read each routed expert where the
        # table b_ptab says, a cache slot or its blob in pinned host memory; the layers' routes go to b_ids_all.
        # With mapped_reads="fetch" a layer's misses are first copied into k staging slots (moe_fetch); "prefetch"
        # adds two more sets of k, alternating by layer, for the predicted experts fetched a layer early
        self.can_map = all(x is not None for x in self._as_is)
        k = cfg.n_expert_used
        self.fetch_layouts = [kmoe.FetchLayout(*(rows * rb for rows, rb in shp)) for shp in self._as_is] \
            if self.can_map else []
        stride = max(f.stride for f in self.fetch_layouts) if self.can_map and self.mapped_reads != "direct" else 0
        fetch_bytes = k * stride
        self.prefetch = self.prefetch and fetch_bytes > 0 and cfg.n_layer > 1
        # two prefetch stagings of k_pred experts each, alternating by layer
        pre_bytes = self.k_pred * stride if self.prefetch else 0
        room -= fetch_bytes + 2 * pre_bytes
        # a batched step may stream its experts (stream_open): two buffers of a layer's experts, alternating by
        # layer, after the cache's slots; only where they take at most half the room (the cache is decode's)
        self.n_stream = cfg.n_expert if self.batch is not None and 4 * cfg.n_expert * self.slot_bytes <= room else 0
        room -= 2 * self.n_stream * self.slot_bytes
        self.n_slots = int(max(0, min(room // self.slot_bytes, cfg.n_layer * cfg.n_expert)))
        # the stream buffers are the cache's too between streamed steps (lent_slots): 2 x 512 slots more for
        # flash, idle while a decode runs (bench/sim_cache.py: 73.5 -> 77.8% hits under 24 GiB; +3.6-5.1 points on
        # the H100, bench/RESULTS.md "fifteenth session")
        unheld = cfg.n_layer * cfg.n_expert - self.n_slots
        self.n_lend = max(0, min(2 * self.n_stream, unheld))
        # one slot even with none to hand out: the job tables need a valid base (every slot id is then -1)
        n_all = max(self.n_slots + 2 * self.n_stream, 1)
        # and so are the batched step's activations, as the slots after the stream buffers (slot ids n_all ..):
        # 4,234 slots (5.8 GB) at flash's 4096-row steps under 24 GiB, rewritten by every batched step and idle
        # while tokens decode (hits 76.3 -> 86.6-86.8% on the H200, bench/RESULTS.md "sixteenth session")
        self.n_lend_act = 0
        if self.n_slots and self.n_lend == 2 * self.n_stream:
            self.n_lend_act = max(0, min(act_bytes // self.slot_bytes, unheld - self.n_lend))
        self.n_lend += self.n_lend_act
        slots = self.A.reserve("expert_slots", (n_all * self.slot_bytes + act_bytes,), U8)
        if act is not None:
            self.A.place(act, slots, n_all * self.slot_bytes)
        self.slot_buf = slots
        # the activations' slots a step of each bucket writes (BatchPath.touched): a short chunk takes back few
        self._act_ids: dict[int, np.ndarray] = {}
        if self.n_lend_act:
            for b in self.batch.buckets:
                self._act_ids[b] = n_all + self.batch.touched_slots(b, self.slot_bytes, self.n_lend_act)
        self._act_dirty = np.zeros(self.n_lend_act, bool)   # an expert went in since the slot was last zeroed
        og, ou = 0, self.slot_parts[0]
        od = ou + self.slot_parts[1]
        st = (self.slot_bytes,) * 3
        for tg, tu, td in types:
            n = n_all + self.n_lend_act
            self.banks.append(kmoe.ExpertBank(
                DevMat(slots, int(tg), Fn, E, device_row_bytes(tg, E), n), og,
                DevMat(slots, int(tu), Fn, E, device_row_bytes(tu, E), n), ou,
                DevMat(slots, int(td), E, Fn, device_row_bytes(td, Fn), n), od, st))
        self._slot_of: dict[tuple[int, int], int] = {}
        self._owner: list[tuple[int, int] | None] = [None] * (self.n_slots + self.n_lend)
        self._slots = np.full((cfg.n_layer, cfg.n_expert), -1, I32)    # the same map, for vectorized lookups
        if self.can_map:
            self.b_ptab = self.A.reserve("expert_ptab", (cfg.n_layer, cfg.n_expert, 3), np.uint64)
            self.b_ids_all = self.A.reserve("ids_all", (cfg.n_layer, k), I32)
            self.expert_job_m = [self.A.reserve(f"blk.{il}.moe_job_mapped", (kmoe.MOE_JOB_DTYPE.itemsize,), U8)
                                 for il in range(cfg.n_layer)]
            if fetch_bytes:
                self.b_fetch = self.A.reserve("expert_fetch_staging", (fetch_bytes,), U8)
                self.b_fetched = self.A.reserve("expert_fetched", (cfg.n_layer, k, 3), np.uint64)
            if self.prefetch:            # layer l's prediction (row l, made beside layer l - 1) and its fetch
                kp = self.k_pred
                self.b_pre_stage = [self.A.reserve(f"expert_prefetch_staging{i}", (pre_bytes,), U8) for i in (0, 1)]
                self.b_pre_eff = self.A.reserve("expert_prefetched", (cfg.n_layer, kp, 3), np.uint64)
                self.b_pred_ids = self.A.reserve("expert_predicted", (cfg.n_layer, kp), I32)
                self.b_pred_logits = self.A.reserve("router_predicted", (cfg.n_expert,))
                self.b_pred_wts = self.A.reserve("route_weights_predicted", (kp,))

    def _upload(self) -> None:
        up = Uploader(self.stream)
        t0 = time.time()
        for dst, src in self._uploads:
            up.put(dst, src() if callable(src) else src)
        up.finish()
        self._uploads = []
        self.log(f"strata.cuda: uploaded {up.bytes / 2**30:.2f} GiB of weights in {time.time() - t0:.1f}s")

    def _host_buffers(self) -> None:
        cfg, k, E = self.cfg, self.cfg.n_expert_used, self.cfg.n_embd
        # the small staging buffers are mapped: kernels copy them on the compute stream (host_copy_launch)
        self.h_step = drv.HostBuffer(self.b_step.nbytes, mapped=True, what="step staging")
        self.step = self.h_step.array(I32, self.b_step.shape)
        self.step[:] = 0
        Tm = self.max_step_tokens
        self.h_ple = drv.HostBuffer(4 * Tm * max(cfg.ple_dim, 1), mapped=True, what="PLE staging")
        self.ple_rows = self.h_ple.array(F32, (Tm, max(cfg.ple_dim, 1)))
        self.ple_stage = self.ple_rows[0]
        if self.batch is not None:
            self.batch.host_buffers()
        self.h_post = drv.HostBuffer(POST_PARTS_OFFSET + 4 * k * E, what="post staging")
        self.post_slots = self.h_post.array(I32, (k,))
        self.post_parts = self.h_post.array(F32, (k, E), POST_PARTS_OFFSET)
        self.h_logits = drv.HostBuffer(4 * cfg.n_vocab, what="logits")
        self.logits = self.h_logits.array(F32, (cfg.n_vocab,))
        self.ev_head = drv.Event()
        self.ev_pre = [drv.Event() for _ in range(cfg.n_layer)]
        self.ev_mark = drv.Event()
        self.ev_side = drv.Event()              # take_lent: the side stream's copies so far
        if self.experts == "host":
            # load_expert copies run on the side stream, in order: the first load after a launch makes the side
            # stream wait for the launches so far (they may read a slot's old expert: ev_mark), and the next post
            # waits once for every load before it (ev_loads[i], which also keeps the blobs those loads read alive)
            self._mark_needed = True
            self._loaded: list[object] = []              # blobs (or staging) read by loads not yet waited for
            self.h_load = [drv.HostBuffer(self.slot_bytes, what="expert staging") for _ in range(LOAD_STAGING)]
            self.ev_load = [drv.Event() for _ in range(LOAD_STAGING)]
            self.load_used = [False] * LOAD_STAGING
            self.load_turn = 0
            # pinned cells for the host's expert blobs (host_alloc): an upload from one is a single DMA, and the
            # blob is kept alive (its cell not reused) until the event after its copies has completed
            dev = self.dev

            self._uva = True                    # every cell's device address is its host address (map_experts)

            def pinned_chunk(n: int):
                dev.make_current()              # the expert store allocates on its I/O threads
                h = drv.HostBuffer(n, mapped=True, what="expert blobs")
                if h.dptr != h.ptr:
                    self._uva = False
                return h.ptr, h
            self.cells = Cells(self.slot_bytes, pinned_chunk)
            self.ev_loads = [drv.Event() for _ in range(LOAD_EVENTS)]
            self.loads_turn = 0
            self._inflight: list[object] = [None] * LOAD_EVENTS       # what each event's copies read
            # streamed steps: the copies of layer l start once post[l - 2] is done (ev_post_done, per parity) and
            # post[l] waits for their end (ev_s1[l]); ev_s0 and ev_m time the copies and what post[l] waited;
            # ev_p0 (before pre[l]) and ev_p1 (after post[l]) time the layer's compute and the device's idle gaps
            n = cfg.n_layer if self.n_stream else 0
            self.ev_begin = drv.Event()
            self.ev_post_done = [drv.Event(), drv.Event()]
            self.ev_s0, self.ev_s1, self.ev_m, self.ev_p0, self.ev_p1 = (
                [drv.Event(timing=True) for _ in range(n)] for _ in range(5))
            self._stream: list[dict | None] = [None, None]
            self._stream_keep: list[tuple] = []
            self._stream_log: list[tuple] = []
            self._posted = -1
            if drv.CopyBatch.probe() is False:
                self.log(f"strata.cuda: expert copies go one driver call each: {drv.CopyBatch.why}")
            self._copies = drv.CopyBatch(self.side)     # load_expert's and stream_experts' copies
            self.h2d_bytes_per_s = self._measure_h2d()
            # mapped tokens: the table's host mirror, the token's routes, loads whose copies may still run
            self.mapped = False
            self._host_addr: np.ndarray | None = None
            self._map_refs: list = []
            self._pend_slot = np.full(max(self.n_slots + self.n_lend, 1), -1, np.int32)   # slot -> ev_loads turn
            self._pend_turns: set[int] = set()
            self._loaded_slots: list[int] = []
            self._retab: list[tuple[int, int]] = []     # table entries whose residency may have changed
            self._retab_all = False
            self._eff = np.zeros((cfg.n_layer, cfg.n_expert), bool)         # the table's VRAM entries
            self._tok_eff = self._eff                                       # ... as the last mapped token read it
            if self.can_map:
                self.h_ptab = drv.HostBuffer(self.b_ptab.nbytes, mapped=True, what="expert address table")
                self._ptab_copy: dict[tuple[int, int], Launch] = {}
                self.ptab = self.h_ptab.array(np.uint64, self.b_ptab.shape)
                self.h_ids_all = drv.HostBuffer(self.b_ids_all.nbytes, what="mapped token routes")
                self.ids_all = self.h_ids_all.array(I32, self.b_ids_all.shape)
                if self.prefetch:
                    self.h_pred = drv.HostBuffer(self.b_pred_ids.nbytes, what="mapped token predictions")
                    self.pred_all = self.h_pred.array(I32, self.b_pred_ids.shape)
                self.ev_ptab = drv.Event()
                # the device's side of a mapped token, for the trace (mapped_timing): events before its table
                # copy, before its graph and after it; and around the promotions' copies on the side stream
                # (opened by the first load after a token, closed at the next token's launch)
                self.ev_tok = [drv.Event(timing=True) for _ in range(3)]
                self.ev_prom = [drv.Event(timing=True), drv.Event(timing=True)]
                self._prom_state: str | tuple = "idle"    # "idle", "open", or (experts, bytes) once closed
                self._prom_last: tuple[int, int, float] | None = None

    def _measure_h2d(self) -> float:
        """Bytes a second of a copy from pinned memory into the expert slots (the best of three 64 MiB copies;
        the slots hold nothing yet): the host's cost model prices uploads and streams with it."""
        n = min(64 << 20, self.slot_buf.nbytes)
        h = drv.HostBuffer(n, what="upload rate probe")
        a, b = drv.Event(timing=True), drv.Event(timing=True)
        try:
            best = 0.0
            for _ in range(3):
                a.record(self.side)
                drv.memcpy_htod_async(self.slot_buf.ptr, h.ptr, n, self.side, "upload rate probe")
                b.record(self.side)
                b.synchronize("upload rate probe")
                best = max(best, n / max(b.elapsed_ms(a) * 1e-3, 1e-9))
            return best
        finally:
            a.destroy()
            b.destroy()
            h.free()

    # ---- the launches, stage by stage -------------------------------------------------------------------
    def _plan_launches(self) -> None:
        """Every launch of every graph, as _Later builders; GEMV job tables are reserved in the arena here."""
        cfg, K = self.cfg, self.kern
        E, hc, eps = cfg.n_embd, cfg.hc, cfg.rms_eps

        def gemv(name: str, jobs: list[Job]) -> _Later:
            table = kgemv.job_table(name + ".jobs", len(jobs), self.A.reserve)
            return _Later(kgemv.gemv_launch, K.fn("gemv", "gemv_jobs"), name, table, jobs)

        L0 = self.L[0]
        first_norm = None if 0 in cfg.ple_layers else L0["hc_attn_norm"]
        begin = [_Later(kgemv.embed_launch, K.fn("gemv", "embed_rms"), "embed", self.w_embd, self.b_step, self.b_R,
                        first_norm, self.b_xn, hc, eps)]
        pre, pre_tok, post, post_m, pref = [], [], [], [], []
        for il in range(cfg.n_layer):
            d, s, p = self.L[il], self.S[il], f"blk.{il}."
            st: list[tuple[str, list]] = []
            if il in cfg.ple_layers:
                st.append(("ple", [
                    _Later(lambda: kgemv.host_copy_launch(K.fn("gemv", "host_copy"), "PLE vector", self.b_ple_e,
                                                          self.h_ple.dptr, 4 * cfg.ple_dim)),
                    gemv(p + "ple_proj", [Job(d["ple_key"], self.b_ple_e, self.b_ple_key),
                                          Job(d["ple_value"], self.b_ple_e, self.b_ple_value)]),
                    _Later(kple.ple_launches, lambda n: K.fn("ple", n), p + "ple", cfg, self.b_R, self.b_ple_key,
                           self.b_ple_value, self.b_ple_gate, d["ple_norm_key"], d["ple_norm_query"],
                           d["ple_norm_conv"], d["ple_conv1d"], self.b_ple_hist, self.b_step)]))
            read = [_Later(khc.rms_group_launch, K.fn("hc", "rms_group"), p + "attn_norm", self.b_R,
                           d["hc_attn_norm"], self.b_xn, hc, E, eps)] if il in cfg.ple_layers else []
            read += [gemv(p + "attn_down_inject", [Job(d["hc_attn_down"], self.b_xn, self.b_lo),
                                                   Job(d["hc_attn_inject"], self.b_xn, self.b_inj_a)]),
                     _Later(khc.up_mix_launch, K.fn("hc", "up_mix"), p + "attn_up_mix", d["hc_attn_up"], self.b_lo,
                            self.b_xn, self.b_mixed, hc, E)]
            st.append(("attn_read", read))
            if cfg.recurrent[il]:
                mixer = [gemv(p + "gdn_proj", [Job(d["attn_qkv"], self.b_mixed, self.b_qkv),
                                               Job(d["attn_gate"], self.b_mixed, self.b_z),
                                               Job(d["ssm_alpha"], self.b_mixed, self.b_alpha),
                                               Job(d["ssm_beta"], self.b_mixed, self.b_beta)]),
                         _Later(kgdn.gdn_core_launch, K.fn("gdn", "gdn_core"), p + "gdn_core", cfg, self.b_qkv,
                                self.b_z, self.b_alpha, self.b_beta, d["ssm_conv1d"], d["ssm_dt"], d["ssm_a"],
                                d["ssm_norm"], s["ring"], s["S"], self.b_y, self.b_step),
                         gemv(p + "ssm_out", [Job(d["ssm_out"], self.b_y, self.b_mix_out)])]
            else:
                mixer = [gemv(p + "qsa_proj", [Job(d["attn_q"], self.b_mixed, self.b_qg),
                                               Job(d["attn_k"], self.b_mixed, self.b_kr),
                                               Job(d["attn_v"], self.b_mixed, self.b_vr),
                                               Job(d["indexer_q_proj"], self.b_mixed, self.b_iqr),
                                               Job(d["indexer_k_proj"], self.b_mixed, self.b_ikr)]),
                         _Later(kqsa.prep_launch, K.fn("qsa", "qsa_prep"), p + "qsa_prep", cfg, il, self.b_qg,
                                self.b_kr, self.b_vr, self.b_iqr, self.b_ikr, d["attn_q_norm"], d["attn_k_norm"],
                                d["indexer_q_norm"], d["indexer_k_norm"], self.inv_freq, self.b_q, s["Kc"], s["Vc"],
                                self.b_iq, s["idx_raw"], s["idx_blk"], self.b_step, self.max_ctx),
                         _Later(kqsa.score_launch, K.fn("qsa", "qsa_score"), p + "qsa_score", cfg, il, self.b_iq,
                                s["idx_blk"], self.b_scores, self.b_step, self.max_ctx, self.dev.n_sm),
                         _Later(kqsa.select_launch, K.fn("qsa", "qsa_select"), p + "qsa_select", cfg, il,
                                self.b_scores, self.b_sel, self.b_meta, self.b_step, self.max_ctx),
                         _Later(kqsa.attn_launch, lambda n: K.fn("qsa", n), p + "qsa_attn", cfg, il, self.b_q, s["Kc"],
                                s["Vc"], self.b_sel, self.b_meta, self.b_part, self.b_step, self.max_ctx, self.nsplit),
                         _Later(kqsa.combine_launch, K.fn("qsa", "qsa_combine"), p + "qsa_combine", cfg, self.b_part,
                                self.b_qg, self.b_att, self.nsplit, self.b_step),
                         gemv(p + "attn_output", [Job(d["attn_output"], self.b_att, self.b_mix_out)])]
            st.append(("mixer", mixer))
            st.append(("attn_write", [_Later(khc.write_rms_launch, K.fn("hc", "write_rms"), p + "attn_write", self.b_R,
                                             self.b_inj_a, self.b_mix_out, d["hc_ffn_norm"], self.b_xn, hc, E, eps)]))
            st.append(("ffn_read", [gemv(p + "ffn_down_inject", [Job(d["hc_ffn_down"], self.b_xn, self.b_lo),
                                                                 Job(d["hc_ffn_inject"], self.b_xn, self.b_inj_f)]),
                                    _Later(khc.up_mix_launch, K.fn("hc", "up_mix"), p + "ffn_up_mix", d["hc_ffn_up"],
                                           self.b_lo, self.b_xn, self.b_x_ffn, hc, E)]))
            router = gemv(p + "router", [Job(d["router"], self.b_x_ffn, self.b_logits_r)])

            def route(db, ids, il=il, p=p):
                return _Later(kmoe.route_launch, K.fn("moe", "moe_route"), p + "route", cfg, il, self.b_logits_r,
                              self.b_x_ffn, ids, self.b_wts, self.b_step, db, self.b_ticket)
            # The shared expert (its gate vector, its gate/up pair, its down projection) reads only the MoE input and
            # only the combine reads its result: in a whole-token graph it is a branch beside the router, the route and
            # the routed experts (_enq_token_layer), which keeps its 3.4 MB off the route's critical path.
            shared = ("shared", [gemv(p + "shexp_gate_up", [Job(d["shexp_gate"], self.b_x_ffn, self.b_sg),
                                                            Job(d["ffn_gate_shexp"], self.b_x_ffn, self.b_h_sh,
                                                                w2=d["ffn_up_shexp"])]),
                                 gemv(p + "shexp_down", [Job(d["ffn_down_shexp"], self.b_h_sh, self.b_shared)])])
            pre.append(st + [("route", [router, route(self.db.ptrs, self.b_ids)]), shared])
            w_next = self.L[il + 1]["hc_attn_norm"] if il + 1 < cfg.n_layer else self.w_out_norm

            def post_of(job, slots, ptab=None, il=il, p=p, w_next=w_next):
                fetch = []
                if ptab is not None and self.mapped_reads != "direct":     # the misses into VRAM staging first
                    pre = (self.b_pred_ids.row(il), self.b_pre_eff.row(il)) if self.prefetch and il > 0 else None
                    fetch = [("fetch", [_Later(lambda ptab=ptab, slots=slots, il=il, p=p, pre=pre: kmoe.fetch_launch(
                        K.fn("moe", "moe_fetch"), p + "fetch", cfg, ptab, slots, self.b_fetched.row(il), self.b_fetch,
                        self.fetch_layouts[il], self.A.base, self.A.base + self.A.total, 2 * self.dev.n_sm, pre))])]
                    ptab = self.b_fetched.row(il)
                return fetch + [
                        ("experts", [_Later(kmoe.expert_launches, K.fn("moe", "moe_gate_up"), K.fn("moe", "moe_down"),
                                            p + "experts", cfg, job, self.banks[il], slots, self.b_x_ffn,
                                            self.b_h_exp, self.b_gpu_parts, ptab, bool(fetch))]),
                        ("combine", [_Later(kmoe.combine_launch, K.fn("moe", "combine_write_rms"), p + "combine",
                                            cfg, self.b_wts, slots, self.b_gpu_parts, self.b_host_parts,
                                            self.b_shared, self.b_sg, self.b_inj_f, self.b_R, self.b_comb, w_next,
                                            self.b_xn)])]
            post.append(post_of(self.expert_job[il], self.b_ids if self.experts == "vram" else self.b_slots))
            if self.experts == "vram":
                pre_tok.append(st + [("route", [router, route(None, self.b_ids)]), shared])
            elif self.can_map:          # the mapped token: routes kept per layer, experts found through the table
                ids = self.b_ids_all.row(il)
                if self.prefetch and il + 1 < cfg.n_layer:      # the next layer's router on this MoE input too
                    router = gemv(p + "router", [Job(d["router"], self.b_x_ffn, self.b_logits_r),
                                                 Job(self.L[il + 1]["router"], self.b_x_ffn, self.b_pred_logits)])
                pre_tok.append(st + [("route", [router, route(None, ids)]), shared])
                post_m.append(post_of(self.expert_job_m[il], ids, self.b_ptab.row(il)))
                if self.prefetch and il + 1 < cfg.n_layer:
                    pref.append(self._prefetch_plan(il + 1))
        head = [gemv("output_down", [Job(self.w_out_down, self.b_xn, self.b_lo)]),
                _Later(khc.up_mix_launch, K.fn("hc", "up_mix"), "output_up_mix", self.w_out_up, self.b_lo, self.b_xn,
                       self.b_mixed, hc, E),
                gemv("lm_head", [Job(self.w_out, self.b_mixed, self.b_logits)])]
        self._plans = (begin, pre, pre_tok, post, post_m, pref, head)

    def _prefetch_plan(self, il: int) -> list[tuple[str, list]]:
        """Layer il's prediction and prefetch, run beside layer il - 1 (mapped_reads="prefetch"): the top k_pred
        (k + prefetch_extra; no doorbell) of layer il's router logits on layer il - 1's MoE input (a second job of
        layer il - 1's router launch: a GEMV on this branch would compete for every SM) into b_pred_ids[il], and
        those experts' misses fetched into staging set il % 2 by a few CTAs (the layer's compute keeps the rest of
        the GPU)."""
        cfg, K, p = self.cfg, self.kern, f"blk.{il}."
        stage = self.b_pre_stage[il % 2]
        return [("predict", [_Later(kmoe.route_launch, K.fn("moe", "moe_route"), p + "route_predicted", cfg, il,
                                    self.b_pred_logits, self.b_x_ffn, self.b_pred_ids.row(il), self.b_pred_wts,
                                    self.b_step, None, self.b_ticket, 1, self.k_pred)]),
                ("prefetch", [_Later(lambda: kmoe.fetch_launch(
                    K.fn("moe", "moe_fetch"), p + "prefetch", cfg, self.b_ptab.row(il), self.b_pred_ids.row(il),
                    self.b_pre_eff.row(il), stage, self.fetch_layouts[il], self.A.base, self.A.base + self.A.total,
                    PREFETCH_CTAS, k=self.k_pred))])]

    def _build_launches(self) -> None:
        """After the commit: the launches (their addresses now exist) and the job tables' contents."""
        begin, pre, pre_tok, post, post_m, pref, head = self._plans
        del self._plans

        def build(stages):
            out = []
            for name, items in stages:
                launches: list[Launch | CopyH2D] = []
                for it in items:
                    got = it()
                    launches += list(got) if isinstance(got, tuple) else [got]
                out.append((name, launches))
            return out

        self.begin_stages = build([("embed", begin)])
        self.pre = [build(x) for x in pre]
        self.pre_tok = [build(x) for x in pre_tok] if pre_tok else None
        self.post = [build(x) for x in post]
        self.post_m = [build(x) for x in post_m] if post_m else None
        self.pref = [build(x) for x in pref]          # pref[l]: beside layer l, layer l + 1's prefetch
        self.head_stages = build([("head", head)])
        self.step_copy = kgemv.host_copy_launch(self.kern.fn("gemv", "host_copy"), "step", self.b_step,
                                                self.h_step.dptr, 4 * (STEP_WORDS + 1))
        if self.batch is not None:
            self.batch.build()

    # ---- enqueueing and capture -------------------------------------------------------------------------
    def _enq(self, stages) -> None:
        for _, launches in stages:
            for launch in launches:
                launch.enqueue(self.stream)

    def _enq_begin(self) -> None:
        self.step_copy.enqueue(self.stream)
        self._enq(self.begin_stages)

    def _enq_head(self) -> None:
        self._enq(self.head_stages)
        drv.memcpy_dtoh_async(self.h_logits.ptr, self.b_logits.ptr, 4 * self.cfg.n_vocab, self.stream, "logits")

    def _capture(self) -> None:
        n = self.cfg.n_layer
        self._g["begin"] = Graph("begin", self.stream, self._enq_begin)
        for il in range(n):
            self._g[("pre", il)] = Graph(f"pre[{il}]", self.stream, lambda il=il: self._enq(self.pre[il]))
            self._g[("post", il)] = Graph(f"post[{il}]", self.stream, lambda il=il: self._enq(self.post[il]))
        self._g["head"] = Graph("head", self.stream, self._enq_head)
        if self.pre_tok is not None:
            self._g["token"] = Graph("token", self.stream, self._enq_token)
        if self.batch is not None:
            self.batch.capture()

    def _enq_token(self) -> None:
        """The whole-token graph's body: begin, every layer's pre and post, the head."""
        post = self.post if self.experts == "vram" else self.post_m
        self._enq_begin()
        for il in range(self.cfg.n_layer):
            pref = self.pref[il] if il < len(self.pref) else None      # none with every expert in VRAM
            self._enq_token_layer(il, self.pre_tok[il], post[il], pref, il > 0 and bool(self.pref))
        self._enq_head()
        if self.experts == "host":      # the layers' routes (and predictions), for the host's cache policy
            drv.memcpy_dtoh_async(self.h_ids_all.ptr, self.b_ids_all.ptr, self.b_ids_all.nbytes,
                                  self.stream, "mapped token routes")
            if self.pref:
                drv.memcpy_dtoh_async(self.h_pred.ptr, self.b_pred_ids.ptr, self.b_pred_ids.nbytes,
                                      self.stream, "mapped token predictions")

    def _fork(self, branch: drv.Stream, ev: drv.Event) -> None:
        """branch continues from the main stream's current point (in a capture: a fork of the graph)."""
        pdl = self.stream.prev_kernel
        ev.record(self.stream)
        self.stream.prev_kernel = pdl   # the record adds no node: the next kernel still follows the last one
        branch.wait(ev)

    def _enq_token_layer(self, il: int, pre, post, pref=None, joins: bool = False) -> None:
        """pre[l] and post[l] inside a whole-token graph. The shared expert reads only the MoE input (the ffn
        read's output) and only the combine reads its result, so it runs on a second branch beside the router, the
        route and the routed experts: forked after the ffn read, joined before the combine. pref
        (mapped_reads="prefetch"): layer l + 1's prediction and prefetch, on a third branch forked once this
        layer's router launch has written the next layer's logits too; joins: layer l - 1 forked one, so this
        layer's ffn read waits for that prediction (this layer's router launch rewrites the logits it reads), and
        its fetch for that prefetch."""
        main = self.stream
        shared = next(launches for name, launches in pre if name == "shared")
        for name, launches in pre:
            if name == "shared":
                continue
            if name == "ffn_read" and joins:
                main.wait(self.ev_pred)
            if name == "route" and pref is not None:   # the router launch wrote the prediction's logits: fork
                launches[0].enqueue(main)
                self._fork(self.branch2, self.ev_fork2)
                for stage, launches2 in pref:
                    for launch in launches2:
                        launch.enqueue(self.branch2)
                    (self.ev_pred if stage == "predict" else self.ev_pref[(il + 1) % 2]).record(self.branch2)
                launches = launches[1:]
            for launch in launches:
                launch.enqueue(main)
            if name != "ffn_read":
                continue
            if self.shared_on_branch:
                self._fork(self.branch, self.ev_fork)
                for launch in shared:
                    launch.enqueue(self.branch)
                self.ev_join.record(self.branch)
            else:
                for launch in shared:
                    launch.enqueue(main)
        for name, launches in post:
            if name == "combine" and self.shared_on_branch:
                main.wait(self.ev_join)
            if name == "fetch" and joins:
                main.wait(self.ev_pref[il % 2])
            for launch in launches:
                launch.enqueue(main)

    def _run(self, key, enqueue) -> None:
        if self.graphs:
            self._g[key].launch(self.stream)
        else:
            enqueue()

    # ---- the protocol -----------------------------------------------------------------------------------
    def _check_seq(self, seq: _Seq, call: str, *phases: str, layer: int | None = None) -> None:
        if seq is not self.seq or not seq.live:
            raise BackendError(f"{call}: not the backend's live sequence (one sequence at a time on the GPU)")
        if seq.phase not in phases:
            raise BackendError(f"{call}: sequence is at '{seq.phase}'" + (f" of layer {seq.layer}" if seq.layer >= 0
                                                                        else "") + f", expected {' or '.join(phases)}")
        if layer is not None and layer != seq.layer:
            raise BackendError(f"{call}: layer {layer}, the sequence is at layer {seq.layer}")

    @_guarded
    def new_seq(self, dump: StageDump | None = None) -> _Seq:
        if self.seq is not None and self.seq.live:
            raise BackendError("new_seq: a sequence is already live; the CUDA backend runs one at a time "
                               "(free_seq it first)")
        for a in self.state:
            drv.memset_async(a.ptr, a.nbytes, self.stream, a.name)
        self.seq = _Seq(dump)
        return self.seq

    def _seq_arrays(self, pos: int) -> list[DevArray]:
        """The device state of a sequence at position pos: the recurrent state (GDN rings and states, the PLE conv
        history) and the first pos cells of every QSA cache (and the pos // ratio complete blocks' keys)."""
        out = list(self.state)
        for il, s in self.S.items():
            if "Kc" not in s:
                continue
            nb = pos // self.cfg.compress_ratios[il]
            for key, n in (("Kc", pos), ("Vc", pos), ("idx_raw", pos), ("idx_blk", nb)):
                a = s[key]
                if n:
                    out.append(a.view("prefix", 0, (n, *a.shape[1:]), a.dtype))
        return out

    @_guarded
    def snapshot(self, seq: _Seq) -> tuple[tuple[int, list[np.ndarray]], int]:
        """A host copy of seq's state between steps (prefix reuse, strata.host.prefix) and its bytes."""
        self._check_seq(seq, "snapshot", "idle")
        self.stream.synchronize("snapshot")
        arrays = [a.download() for a in self._seq_arrays(seq.pos)]
        return (seq.pos, arrays), sum(a.nbytes for a in arrays)

    @_guarded
    def restore(self, snap: tuple[int, list[np.ndarray]]) -> _Seq:
        """A new live sequence holding a snapshot's state (what new_seq and feeding its tokens would give)."""
        if self.seq is not None and self.seq.live:
            raise BackendError("restore: a sequence is already live; the CUDA backend runs one at a time "
                               "(free_seq it first)")
        pos, arrays = snap
        if pos > self.max_ctx:
            raise BackendError(f"restore: a snapshot at position {pos}, past max_ctx {self.max_ctx}")
        self.stream.synchronize("restore")
        for a, v in zip(self._seq_arrays(pos), arrays, strict=True):
            a.upload(v)
        self.seq = _Seq(None, pos=pos)
        return self.seq

    @_guarded
    def free_seq(self, seq: _Seq) -> None:
        if seq is self.seq:
            self.stream.synchronize("free_seq")
            seq.live = False

    def _step_seq(self, step: Step, call: str) -> _Seq:
        """The one sequence of a step (one row, or a chunk of one sequence's rows), which becomes the step in
        flight."""
        if not 1 <= step.T <= self.max_step_tokens:
            raise BackendError(f"{call}: a step of {step.T} rows; this CUDA backend takes 1 .. {self.max_step_tokens}"
                               f" (max_step_tokens: the step_tokens it was opened with)")
        if len(step.segments) != 1:
            raise BackendError(f"{call}: a step of {len(step.segments)} sequences; the CUDA backend runs one")
        seg = step.segments[0]
        if seg.seq is self.seq and seg.pos != seg.seq.pos:
            raise BackendError(f"{call}: the row is at position {seg.pos}, its sequence at {seg.seq.pos}")
        if step.T > 1 and seg.seq.dump is not None:
            raise BackendError(f"{call}: the per-stage dump runs one row a step (a step of {step.T} rows given)")
        if step.T > 1 and len(step.logit_rows) > self.batch.logit_rows:
            raise BackendError(f"{call}: {len(step.logit_rows)} logit rows; a step gives at most "
                               f"{self.batch.logit_rows} at this vocabulary")
        self.cur = step
        return seg.seq

    @_guarded
    def begin(self, step: Step, route_x: bool = True) -> None:
        seq = self._step_seq(step, "begin")
        self._check_seq(seq, "begin", "idle")
        self.step[STEP_FLAGS] = STEP_ROUTE_X if route_x else 0
        if self.experts == "host" and self._pend_turns:
            self._join_pending()
        if step.T > 1:
            if self._taken is None and self.n_lend_act and any(
                    self._owner[s] is not None for s in self._act_ids[self.batch.bucket(step.T)].tolist()):
                raise BackendError(f"begin: a step of {step.T} rows would overwrite the experts cached in its "
                                   f"activations' slots: take_lent first (lent_slots)")
            self._stage_rows(seq, step, "begin")
            self.batch.run("begin", self.batch.bucket(step.T))
            if self.n_stream:
                self._release_streamed(wait=True)       # a failed step's copies may still be in flight
                self.ev_begin.record(self.stream)
                self._stream, self._stream_log, self._posted = [None, None], [], -1
            seq.phase, seq.layer = "begun", -1
            return
        self._stage_token(seq, int(step.tokens[0]), None, "begin")
        self._run("begin", self._enq_begin)
        if seq.dump is not None:
            self.stream.synchronize("dump: embed")
            seq.dump.put(seq.pos, -1, "embed", self.b_R.row(0).download())
        seq.phase, seq.layer = "begun", -1

    def _stage_words(self, seq: _Seq, tokens: np.ndarray, call: str) -> None:
        """The step words (tokens, positions, ring) into pinned staging (the begin graph copies them)."""
        cfg, T = self.cfg, len(tokens)
        bad = (tokens < 0) | (tokens >= cfg.n_vocab)
        if bad.any():
            raise BackendError(f"{call}: token id {int(tokens[bad][0])} is outside the vocabulary [0, {cfg.n_vocab})")
        if seq.pos + T > self.max_ctx:
            raise BackendError(f"{call}: positions {seq.pos} .. {seq.pos + T - 1}: the context is full "
                               f"(max_ctx {self.max_ctx})")
        seq.ple_ready = False
        if self._ring + cfg.n_layer >= 2**31:       # the ring value travels as an int32 step word
            self._ring = 1
        self.step[STEP_TOKEN], self.step[STEP_POS], self.step[STEP_RING] = int(tokens[0]), seq.pos, self._ring
        self.step[STEP_T] = T
        self.step[STEP_WORDS:STEP_WORDS + T] = tokens

    def _stage_token(self, seq: _Seq, token: int, ple_e, call: str) -> None:
        self._stage_words(seq, np.array([token], np.int64), call)
        self.step[STEP_L] = 1
        if ple_e is not None:
            self._stage_ple(seq, np.asarray(ple_e).reshape(1, -1), 1, call)

    def _stage_rows(self, seq: _Seq, step: Step, call: str) -> None:
        self._stage_words(seq, np.asarray(step.tokens, np.int64), call)
        rows = np.asarray(step.logit_rows, np.int64)
        Tm = self.max_step_tokens
        self.step[STEP_L] = len(rows)
        self.step[STEP_WORDS + Tm:STEP_WORDS + Tm + len(rows)] = rows

    def _stage_ple(self, seq: _Seq, ple_e: np.ndarray, T: int, call: str) -> None:
        cfg = self.cfg
        if not cfg.ple_layers:
            raise BackendError(f"{call}: this model has no PLE layer")
        if np.shape(ple_e) != (T, cfg.ple_dim):
            raise BackendError(f"{call}: the PLE rows must be ({T}, {cfg.ple_dim}), got {np.shape(ple_e)}")
        self.ple_rows[:T] = ple_e
        seq.ple_ready = True

    @_guarded
    def stage_ple(self, e: np.ndarray) -> None:
        """The step's PLE rows (T, ple_dim) after begin: any time before launch_pre of the PLE layer, whose graph
        copies them."""
        seq = self._seq_of_step("stage_ple")
        self._check_seq(seq, "stage_ple", "begun", "pre", "routed", "streamed", "post")
        if self.cfg.ple_layers and seq.layer >= self.cfg.ple_layers[0]:
            raise BackendError(f"stage_ple: layer {seq.layer} is already past the PLE layer {self.cfg.ple_layers[0]}")
        self._stage_ple(seq, np.asarray(e, F32).reshape(self.cur.T, -1), self.cur.T, "stage_ple")

    def _seq_of_step(self, call: str) -> _Seq:
        if self.cur is None:
            raise BackendError(f"{call}: no step was begun")
        return self.cur.segments[0].seq

    def _dump_stage(self, seq: _Seq, layer: int, stage: str) -> None:
        value = {"ple": self.b_R, "attn_read": self.b_mixed, "mixer": self.b_mix_out, "attn_write": self.b_R,
                 "ffn_read": self.b_x_ffn, "route": self.b_wts, "combine": self.b_comb, "ffn_write": self.b_R}
        if stage in ("shared", "fetch"):
            return
        self.stream.synchronize(f"dump: layer {layer} {stage}")
        if stage == "experts":
            g = self.b_gpu_parts.download()
            seq.dump.put(seq.pos, layer, stage, g if seq.mask.all() else np.where(seq.mask[:, None], g, seq.parts))
            return
        seq.dump.put(seq.pos, layer, stage, value[stage].download())
        if stage == "combine":
            seq.dump.put(seq.pos, layer, "ffn_write", self.b_R.download())

    def _run_stages(self, seq: _Seq, key, stages, layer: int) -> None:
        if seq.dump is None:
            self._run(key, lambda: self._enq(stages))
            return
        for name, launches in stages:
            for launch in launches:
                launch.enqueue(self.stream)
            self._dump_stage(seq, layer, name)

    @_guarded
    def launch_pre(self, layer: int) -> None:
        seq = self._seq_of_step("launch_pre")
        if layer == 0:
            self._check_seq(seq, "launch_pre", "begun")
        else:             # a streamed layer's route is not read before the next pre (streamed_routes after the step)
            self._check_seq(seq, "launch_pre", "post", "streamed", layer=layer - 1)
        if layer in self.cfg.ple_layers and not seq.ple_ready:
            raise BackendError(f"launch_pre({layer}): the PLE layer needs the token's PLE vector (begin or stage_ple)")
        seq.layer, seq.route = layer, None
        seq.t_pre = time.monotonic()
        if self.cur.T > 1:
            if self.n_stream:
                self.ev_p0[layer].record(self.stream)
            self.batch.run("pre", self.batch.bucket(self.cur.T), layer)
        else:
            self._run_stages(seq, ("pre", layer), self.pre[layer], layer)
        self.ev_pre[layer].record(self.stream)
        seq.phase = "pre"

    @_guarded
    def poll_route(self, layer: int) -> Route | None:
        seq = self._seq_of_step("poll_route")
        self._check_seq(seq, "poll_route", "pre", "routed", "streamed", layer=layer)
        if seq.phase == "routed":
            return seq.route
        want = (int(self.step[STEP_RING]) + layer) & 0xFFFFFFFF
        if self.db.value() != want:
            done = self.ev_pre[layer].query("pre[%d]", layer)      # a driver call per poll keeps submission moving
            if self.db.value() != want:
                if done:
                    raise BackendError(f"poll_route: pre[{layer}] completed but its doorbell holds "
                                       f"{self.db.value()}, expected {want}")
                if time.monotonic() - seq.t_pre > self.timeout:
                    raise BackendError(f"poll_route: doorbell timeout: pre[{layer}] has not rung in "
                                       f"{self.timeout:.0f}s (holds {self.db.value()}, expected {want})")
                return None
        # x only where the router wrote it (begin's route_x: a streamed step's route carries none)
        seq.route = Route(*self.db.payload(self.cur.T, x=bool(self.step[STEP_FLAGS] & STEP_ROUTE_X)))
        seq.phase = "post" if seq.phase == "streamed" else "routed"
        return seq.route

    @property
    def max_logit_rows(self) -> int:
        """The most logit rows one step gives (a scoring chunk is cut to it)."""
        return 1 if self.batch is None else self.batch.logit_rows

    def resident(self, layer: int, experts: np.ndarray) -> np.ndarray:
        if self.experts == "vram":
            return np.ones(len(experts), bool)
        return self._slots[layer, np.asarray(experts, np.int64)] >= 0

    def expert_slots(self) -> int:
        return self.n_slots + self.n_lend

    def lent_slots(self) -> int:
        """The last lent_slots() of expert_slots() are the cache's while one-row steps run: the stream buffers
        (slots n_slots ..), then the batched step's activations (the last n_lend_act; a step of few rows takes
        back only those its bucket writes)."""
        return self.n_lend

    @_guarded
    def take_lent(self, stream: bool, rows: int) -> np.ndarray:
        """Before a step of `rows` rows: the lent slots it writes leave the cache (the activations' slots its
        bucket touches, and the stream buffers when it streams), their experts no longer resident (the mapped
        table's entries go back to host memory at the next mapped token). Returns those slot ids. The stream
        buffers' copies need no wait: a promotion already queued into one runs on the side stream before the
        step's stream copies, and the step's readers of the buffers come after every launch that read those
        experts. The activations are written by the step's launches on the main stream, so that stream waits for
        the side stream's copies first, then zeroes the taken slots that held experts: the step's kernels find
        every byte no step writes (the pads of its rows) zero, as after setup."""
        act = self._act_ids.get(self.batch.bucket(rows), np.zeros(0, np.int64)) if self.n_lend_act else \
            np.zeros(0, np.int64)
        n_str = self.n_lend - self.n_lend_act
        ids = np.concatenate([np.arange(self.n_slots, self.n_slots + n_str) if stream else np.zeros(0, np.int64),
                              act])
        for slot in ids.tolist():
            self._drop(slot)
        if len(ids):                             # a load still pending into one settles nothing now
            self._pend_slot[ids] = -1
        first = self.n_slots + n_str             # the activations' slot 0
        dirty = act[self._act_dirty[act - first]]
        if len(dirty):
            self.ev_side.record(self.side)
            self.stream.wait(self.ev_side)
            cuts = np.flatnonzero(np.diff(dirty) != 1) + 1
            for run in np.split(dirty, cuts):    # contiguous runs of slots, one memset each
                drv.memset_async(self.slot_buf.ptr + int(run[0]) * self.slot_bytes, len(run) * self.slot_bytes,
                                 self.stream, "the batched step's activations")
            self._act_dirty[dirty - first] = False
        self._taken = np.zeros(self.n_slots + self.n_lend, bool)
        self._taken[ids] = True
        return ids

    def return_lent(self) -> None:
        """After the step's logits: the lent slots are the cache's again (a load into one waits for the launches
        before it, the step's posts and head included, as every load_expert does)."""
        self._taken = None

    @_guarded
    def load_expert(self, layer: int, expert: int, slot: int, gate, up, down) -> None:
        cfg = self.cfg
        if self.experts == "vram":
            raise BackendError("load_expert: experts='vram' holds every expert already")
        if not 0 <= slot < self.n_slots + self.n_lend:
            raise BackendError(f"load_expert: slot {slot} of {self.n_slots + self.n_lend}")
        if self._taken is not None and self._taken[slot]:
            raise BackendError(f"load_expert: slot {slot} is lent to the cache between batched steps and taken "
                               f"back by the step in flight")
        if not (0 <= layer < cfg.n_layer and 0 <= expert < cfg.n_expert):
            raise BackendError(f"load_expert: expert {expert} of layer {layer} does not exist")
        parts = self._device_parts(layer, expert, gate, up, down, "load_expert")
        self._copy_into(slot, parts, (layer, expert, slot), after_launches=True)
        self._loaded.append(parts)                      # kept (a blob's cell) until the copies are done
        self._loaded_slots.append(slot)
        self._own(slot, layer, expert)

    @_guarded
    def loads_done(self) -> None:
        """The load_expert copies so far go to the device now, as one batch (cuMemcpyBatchAsync where the driver
        has it): load_expert only queues them, and the next post, mapped token or stream enqueues what is left."""
        if self.experts == "host":
            self._copies.flush("expert uploads")

    def _drop(self, slot: int) -> None:
        """Cache slot `slot`'s expert, if any, is no longer resident."""
        old = self._owner[slot]
        if old is not None:
            del self._slot_of[old]
            self._slots[old] = -1
            self._retab.append(old)
            self._owner[slot] = None

    def _own(self, slot: int, layer: int, expert: int) -> None:
        """Cache slot `slot` holds (layer, expert) from now on; its old expert is no longer resident."""
        self._drop(slot)
        first = self.n_slots + self.n_lend - self.n_lend_act
        if slot >= first:
            self._act_dirty[slot - first] = True
        self._retab.append((layer, expert))
        self._owner[slot] = (layer, expert)
        self._slot_of[(layer, expert)] = slot
        self._slots[layer, expert] = slot

    def host_alloc(self, nbytes: int) -> np.ndarray:
        """Host memory for an expert blob (strata.host.experts.ExpertStore): a pinned cell when experts="host"
        (load_expert then copies straight from it), plain memory otherwise."""
        if self.experts != "host" or nbytes > self.cells.cell_bytes:
            return np.empty(nbytes, np.uint8)
        return self.cells.take(nbytes)

    def _side_after_launches(self) -> None:
        """The side stream's next copy waits for every launch made so far (one may read a slot it overwrites)."""
        if self._mark_needed:
            self.ev_mark.record(self.stream)
            self.side.wait(self.ev_mark)
            self._mark_needed = False
            if self.mapped and self._prom_state == "idle":        # a mapped token's promotions start here
                self.ev_prom[0].record(self.side)
                self._prom_state = "open"

    def _loads_before_post(self) -> None:
        """The main stream waits for every load so far; their sources stay alive until those copies are done."""
        if not self._loaded:
            return
        self.stream.wait(self.ev_loads[self._loads_event()])

    def _loads_event(self) -> int:
        """An event on the side stream after every load so far (its turn in ev_loads); their sources stay alive
        until it has completed."""
        i = self.loads_turn
        if self._inflight[i] is not None:               # LOAD_EVENTS layers ago: long done in practice
            self.ev_loads[i].synchronize("expert uploads")
            self._resolve(i)
        self._copies.flush("expert uploads")
        self.ev_loads[i].record(self.side)
        if self.can_map and self._prom_state == "open":     # the promotions' copies end here
            self.ev_prom[1].record(self.side)
            self._prom_state = (len(self._loaded_slots), sum(p.nbytes for parts in self._loaded for p in parts))
        self._inflight[i], self._loaded, self._loaded_slots = self._loaded, [], []
        self.loads_turn = (i + 1) % LOAD_EVENTS
        return i

    # ---- mapped tokens: the experts a token misses in VRAM are read by its kernels from pinned host memory ------
    @_guarded
    def map_experts(self, blobs) -> bool:
        """Every expert's blob in pinned host memory (blobs[layer][expert]: .gate, .up, .down views in the kernels'
        format, in this backend's pinned cells, kept alive while mapped): from now on a one-row step may run as
        one graph (launch_whole) whose expert kernels read each routed expert from its cache slot, or from its
        blob over PCIe. False (nothing changes) where it cannot: experts='vram', a layer whose types the upload
        converts, or a blob outside the pinned cells."""
        cfg = self.cfg
        if self.experts != "host" or not self.can_map or not self.graphs or not self._uva:
            return False
        if len(blobs) != cfg.n_layer or any(len(b) != cfg.n_expert for b in blobs):
            raise BackendError(f"map_experts: blobs for {len(blobs)} layers; the model has {cfg.n_layer} layers of "
                               f"{cfg.n_expert} experts")
        addr = np.zeros((cfg.n_layer, cfg.n_expert, 3), np.uint64)
        for il, row in enumerate(blobs):
            shapes = self._as_is[il]
            for e, b in enumerate(row):
                parts = (b.gate, b.up, b.down)
                if tuple(p.shape for p in parts) != shapes or any(p.dtype != U8 or not p.flags.c_contiguous
                                                                   for p in parts):
                    return False
                a = [p.__array_interface__["data"][0] for p in parts]
                if not all(self.cells.owns_span(x, p.nbytes) for x, p in zip(a, parts)):
                    return False
                addr[il, e] = a
        self._host_addr, self._map_refs = addr, [list(r) for r in blobs]
        at = np.array([0, self.slot_parts[0], self.slot_parts[0] + self.slot_parts[1]], np.uint64)
        self._slot_addr = (np.uint64(self.slot_buf.ptr) + np.arange(max(self.n_slots + self.n_lend, 1),
                                                                      dtype=np.uint64)[:, None]
                           * np.uint64(self.slot_bytes) + at)              # (slots, 3) each slot's parts
        self._retab_all = True
        self.mapped = True
        return True

    def _resolve(self, turn: int) -> None:
        """The loads of ev_loads[turn] are done: their slots serve mapped tokens from now on."""
        self._inflight[turn] = None
        if turn in self._pend_turns:
            self._pend_turns.discard(turn)
            self._settled(np.flatnonzero(self._pend_slot == turn))

    def _settled(self, slots: np.ndarray) -> None:
        """These slots' copies are done (or waited for by the main stream): their experts are VRAM's again."""
        self._pend_slot[slots] = -1
        self._retab.extend(o for o in (self._owner[i] for i in slots.tolist()) if o is not None)

    def _join_pending(self) -> None:
        """A step that is not a mapped token reads every slot the cache reports resident: the main stream waits
        for the loads still pending from mapped tokens."""
        for turn in list(self._pend_turns):
            self.stream.wait(self.ev_loads[turn])
            self._pend_turns.discard(turn)
            self._settled(np.flatnonzero(self._pend_slot == turn))

    def _sync_ptab(self, mark: drv.Event | None = None) -> None:
        """Before a mapped token: the loads since the last launch get an event (their slots pending until it
        completes: a pending slot is read from host memory), finished loads are resolved, and the rows of the
        layers whose entries changed go to the device table, on the main stream ahead of the token (only the
        changed entries are recomputed: a load changes two, its expert's and the one it evicted). `mark` is
        recorded on the stream after this host work, just before the copy (if any): the device idles while the
        host works here, and mapped_timing's table time is the copy's alone."""
        if self._loaded:
            slots = list(self._loaded_slots)
            turn = self._loads_event()
            self._pend_slot[slots] = turn
            self._pend_turns.add(turn)
        for turn in list(self._pend_turns):
            if self.ev_loads[turn].query("expert uploads"):
                self._resolve(turn)
        if self._retab_all:
            ls, es = (a.reshape(-1) for a in np.indices(self._slots.shape))
        elif self._retab:
            ls, es = np.array(self._retab, np.int64).T
        else:
            if mark is not None:
                mark.record(self.stream)
            return
        self._retab, self._retab_all = [], False
        s = self._slots[ls, es]
        res = s >= 0
        sl = np.maximum(s, 0)
        if self._pend_turns:
            res &= self._pend_slot[sl] < 0
        self.ev_ptab.synchronize("expert address table")          # the last copy of the staging is done (an
                                                                  # event never recorded returns at once)
        self._eff[ls, es] = res
        self.ptab[ls, es] = np.where(res[:, None], self._slot_addr[sl], self._host_addr[ls, es])
        lo, hi = int(ls.min()), int(ls.max()) + 1
        rb = self.ptab[0].nbytes
        if (lo, hi) not in self._ptab_copy:          # a launch a row range (packing one costs ~15 us)
            self._ptab_copy[lo, hi] = kgemv.host_copy_launch(self.kern.fn("gemv", "host_copy"), "expert address table",
                                                             self.b_ptab, self.h_ptab.dptr + rb * lo, rb * (hi - lo),
                                                             rb * lo)
        if mark is not None:
            mark.record(self.stream)
        self._ptab_copy[lo, hi].enqueue(self.stream)
        self.ev_ptab.record(self.stream)

    def _harvest_promotions(self) -> None:
        """The closed promotions' copy time, once their end event has completed (then a new batch may open)."""
        if isinstance(self._prom_state, tuple) and self.ev_prom[1].query("promotion copies"):
            n, nbytes = self._prom_state
            self._prom_last = (n, nbytes, self.ev_prom[1].elapsed_ms(self.ev_prom[0]))
            self._prom_state = "idle"

    def mapped_timing(self) -> dict:
        """After a mapped token's logits: its device time, ms (table: the address table's copy, from its enqueue
        after the host has updated the table; graph: the token's graph), and the newest promotions measured since
        the last call ([experts, bytes, copy ms] from the first copy's start to the last's end; None if none
        completed)."""
        self._harvest_promotions()
        prom, self._prom_last = self._prom_last, None
        return {"table_ms": self.ev_tok[1].elapsed_ms(self.ev_tok[0]),
                "graph_ms": self.ev_tok[2].elapsed_ms(self.ev_tok[1]), "promoted": prom}

    def token_routes(self) -> tuple[np.ndarray, np.ndarray]:
        """After a mapped token's logits: each layer's routed experts (n_layer, k) and which of them the token read
        from VRAM (the rest came from host memory over PCIe)."""
        ids = self.ids_all.copy()
        return ids, self._tok_eff[np.arange(self.cfg.n_layer)[:, None], ids]

    def token_prefetch(self) -> tuple[int, int, int, int] | None:
        """After a mapped token's logits, with mapped_reads="prefetch": (misses, misses predicted, experts
        prefetched, their bytes) over the layers a prediction served (kmoe.prefetch_stats); None otherwise."""
        if not self.prefetch:
            return None
        rows = np.arange(self.cfg.n_layer)[:, None]
        ids, preds = self.ids_all.copy(), self.pred_all.copy()
        res, pres = self._tok_eff[rows, ids], self._tok_eff[rows, preds]
        nbytes = [f.n_g + f.n_u + f.n_d for f in self.fetch_layouts]
        return kmoe.prefetch_stats(ids, res, preds, pres, nbytes)

    def _device_parts(self, layer: int, expert: int, gate, up, down, call: str) -> tuple:
        """The three slices in the kernels' format: as given where the layer's types need no conversion and
        they are uint8 (rows, row bytes) already (a blob's views: the streamed path's common case)."""
        shapes = self._as_is[layer]
        if (shapes is not None and gate.dtype == U8 and up.dtype == U8 and down.dtype == U8
                and (gate.shape, up.shape, down.shape) == shapes):
            return gate, up, down
        cfg = self.cfg
        fg, fu, fd = self.file_types[layer]
        E, Fn = cfg.n_embd, cfg.n_ff_exp
        try:
            return device_rows(gate, fg, Fn, E), device_rows(up, fu, Fn, E), device_rows(down, fd, E, Fn)
        except ValueError as e:
            raise BackendError(f"{call}: layer {layer} expert {expert}: {e}") from None

    def _copy_into(self, slot: int, parts, what: tuple[int, int, int], after_launches: bool) -> None:
        """The expert's three parts into slot `slot` on the side stream: straight from a pinned cell in device
        format (queued in the copy batch, which the caller's flush points send), else through a pinned staging
        buffer. after_launches: the copy waits for every launch so far (a cache slot that one of them may read;
        the copies queued before that wait go ahead of it); a stream slot's wait is stream_open's. what: (layer,
        expert, slot), for an error's message."""
        src = [p.__array_interface__["data"][0] for p in parts]
        at = (0, self.slot_parts[0], self.slot_parts[0] + self.slot_parts[1])
        contiguous = all(p.flags.c_contiguous for p in parts)
        one = contiguous and src[1] - src[0] == at[1] and src[2] - src[0] == at[2]   # laid out as the slot is
        if one and self.cells.owns_span(src[0], at[2] + parts[2].nbytes) or \
                not one and contiguous and all(self.cells.owns_span(a, p.nbytes) for a, p in zip(src, parts)):
            batch = self._copies
            if after_launches:                                                   # pinned, in device format
                if self._mark_needed:            # a wait goes in: the copies before it need not wait too
                    batch.flush(COPY_WHAT, *what)
                self._side_after_launches()
            base = self.slot_buf.ptr + slot * self.slot_bytes
            if one:
                batch.add(base, src[0], at[2] + parts[2].nbytes)
            else:
                for p, a, ptr in zip(parts, at, src):
                    batch.add(base + a, ptr, p.nbytes)
            return
        self._copies.flush(COPY_WHAT, *what)     # the queued copies stay ahead of the staged one
        i = self.load_turn
        if self.load_used[i]:
            self.ev_load[i].synchronize("expert staging reuse")
        buf = self.h_load[i]
        off = 0
        for rows, room in zip(parts, self.slot_parts):
            buf.array(U8, rows.shape, off)[:] = rows
            off += room
        if after_launches:
            self._side_after_launches()
        drv.memcpy_htod_async(self.slot_buf.ptr + slot * self.slot_bytes, buf.ptr, self.slot_bytes, self.side,
                              COPY_WHAT, *what)
        self.ev_load[i].record(self.side)
        self.load_used[i] = True
        self.load_turn = (i + 1) % LOAD_STAGING

    def _drop_streams(self) -> None:
        """A constructor that gives up before the arena frees what it made (the engine may retry smaller)."""
        self.stream.destroy()
        self.side.destroy()
        self.branch.destroy()
        self.branch2.destroy()

    # ---- streamed experts (a batched step under a VRAM budget) -------------------------------------------------
    def stream_slots(self) -> int:
        """Experts of one layer a step may stream (two such buffers, alternating by layer); 0: none."""
        return self.n_stream

    @_guarded
    def stream_open(self, layer: int) -> None:
        """Layer `layer`'s stream buffer takes copies from now on: the side stream first waits for post[layer - 2]
        (its buffer's last reader; the step's begin for layers 0 and 1)."""
        seq = self._seq_of_step("stream_open")
        self._check_seq(seq, "stream_open", "begun", "pre", "routed", "streamed", "post")
        if not self.n_stream:
            raise BackendError("stream_open: no stream buffers (experts='vram', one-row steps only, or a budget "
                               "without room for two layers' experts)")
        if self.cur.T < 2:
            raise BackendError("stream_open: streaming is for a step of several rows")
        if not 0 <= layer < self.cfg.n_layer:
            raise BackendError(f"stream_open: layer {layer} does not exist")
        p, old = layer % 2, self._stream[layer % 2]
        if old is not None and (old["open"] or old["layer"] >= layer):
            raise BackendError(f"stream_open({layer}): layer {old['layer']}'s stream is "
                               f"{'open' if old['open'] else 'newer'}")
        self._copies.flush("expert uploads")    # loads queued so far go before the stream's wait
        if layer >= 2:
            if self._posted < layer - 2:
                raise BackendError(f"stream_open({layer}): post[{layer - 2}], the last reader of its buffer, is not "
                                   f"launched")
            self.side.wait(self.ev_post_done[p])
        else:
            self.side.wait(self.ev_begin)
        self._release_streamed(wait=False)
        self.ev_s0[layer].record(self.side)
        self._stream[p] = {"layer": layer, "slots": {}, "open": True, "n": 0, "bytes": 0, "keep": []}

    @_guarded
    def stream_experts(self, layer: int, items) -> None:
        """Experts of the open layer, in order, each (expert, gate, up, down, slot): into the next stream slot, or
        into cache slot `slot` (not None), free in the host's policy (it then stays resident). A slot that never
        held an expert needs no wait but the stream's; one whose old expert the policy dropped (an eviction that
        freed more room than it used) waits for the launches so far, as load_expert's copies do."""
        s = self._stream[layer % 2] if self.n_stream else None
        if s is None or s["layer"] != layer or not s["open"]:
            raise BackendError(f"stream_experts: layer {layer}'s stream is not open")
        try:
            for expert, gate, up, down, slot in items:
                if not 0 <= expert < self.cfg.n_expert or expert in s["slots"]:
                    raise BackendError(f"stream_experts: expert {expert} of layer {layer} (out of range or streamed "
                                       f"twice)")
                if (layer, expert) in self._slot_of:
                    raise BackendError(f"stream_experts: expert {expert} of layer {layer} is in the cache; a step "
                                       f"streams only what its layers lack")
                if slot is not None and not 0 <= slot < self.n_slots:
                    raise BackendError(f"stream_experts: cache slot {slot} of {self.n_slots}")
                parts = self._device_parts(layer, expert, gate, up, down, "stream_experts")
                used = False
                if slot is None:
                    slot = self.n_slots + (layer % 2) * self.n_stream + len(s["slots"])
                    s["slots"][expert] = slot
                else:
                    used = self._owner[slot] is not None
                    self._own(slot, layer, expert)
                self._copy_into(slot, parts, (layer, expert, slot), after_launches=used)
                s["keep"].append(parts)
                s["n"] += 1
                s["bytes"] += sum(x.nbytes for x in parts)
        finally:           # the copies of the items before a bad one go too: their slots are taken
            self._copies.flush("streamed experts of layer %d", layer)

    @_guarded
    def stream_close(self, layer: int) -> None:
        s = self._stream[layer % 2] if self.n_stream else None
        if s is None or s["layer"] != layer or not s["open"]:
            raise BackendError(f"stream_close: layer {layer}'s stream is not open")
        self.ev_s1[layer].record(self.side)
        s["open"] = False
        self._stream_keep.append((self.ev_s1[layer], s.pop("keep")))   # the blobs live until their copies are done
        self._stream_log.append((layer, s["n"], s["bytes"]))

    def _release_streamed(self, wait: bool) -> None:
        """Drop the blobs of stream copies that are done (all of them, waiting, with wait)."""
        left = []
        for ev, keep in self._stream_keep:
            if wait:
                ev.synchronize("streamed expert copies")
            elif not ev.query("streamed expert copies"):
                left.append((ev, keep))
        self._stream_keep = left

    def stream_times(self) -> list[tuple[int, int, int, float, float, float, float, float]]:
        """After a streamed step's head: (layer, experts, bytes, copy_ms, exposed_ms, pre_ms, post_ms, idle_ms)
        per layer: the device's time from the copies' start (their buffer free) to their end, and of it the part
        after post[layer] reached its wait for them; pre[layer]'s and post[layer]'s time on the compute stream (post
        with that wait); and how long the compute stream sat idle between post[layer - 1] and pre[layer] (a
        launch that came late)."""
        out, streamed = [], {layer for layer, _, _ in self._stream_log}
        for layer, n, nbytes in self._stream_log:
            copy = self.ev_s1[layer].elapsed_ms(self.ev_s0[layer])
            exposed = max(0.0, self.ev_s1[layer].elapsed_ms(self.ev_m[layer]))
            pre = self.ev_m[layer].elapsed_ms(self.ev_p0[layer])
            post = self.ev_p1[layer].elapsed_ms(self.ev_m[layer])
            idle = max(0.0, self.ev_p0[layer].elapsed_ms(self.ev_p1[layer - 1])) if layer - 1 in streamed else 0.0
            out.append((layer, n, nbytes, copy, exposed, pre, post, idle))
        return out

    @_guarded
    def launch_post(self, plan: ExpertPlan) -> None:
        """post[plan.layer] with the plan's host parts for the routes it does not mark resident."""
        seq, layer = self._seq_of_step("launch_post"), plan.layer
        self._check_seq(seq, "launch_post", "routed", layer=layer)
        cfg, k, T = self.cfg, self.cfg.n_expert_used, self.cur.T
        if plan.parts.shape != (T, k, cfg.n_embd):
            raise BackendError(f"launch_post: parts of shape {plan.parts.shape}, expected ({T}, {k}, {cfg.n_embd})")
        if T > 1:
            self._post_rows(seq, plan)
            return
        mask, parts = plan.mask[0], plan.parts[0]
        ids = seq.route.ids[0]
        if self.experts == "vram":
            if not mask.all():
                raise BackendError("launch_post: experts='vram' computes every routed expert; the mask says the "
                                   "host computed some")
        else:
            if (~mask).any():
                self.post_parts[~mask] = parts[~mask]
            slots = np.where(mask, self._slots[layer, np.asarray(ids, np.int64)], -1)
            bad = mask & (slots < 0)
            if bad.any():
                raise BackendError(f"launch_post: expert {int(ids[bad][0])} of layer {layer} is marked resident "
                                   f"but is in no cache slot")
            self.post_slots[:] = slots
            self._loads_before_post()
            drv.memcpy_htod_async(self.b_post_in.ptr, self.h_post.ptr, self.h_post.nbytes, self.stream,
                                  "post[%d] inputs", layer)
        seq.mask = mask
        seq.parts = None if seq.dump is None else np.array(parts, F32)
        self._run_stages(seq, ("post", layer), self.post[layer], layer)
        if self.experts == "host":
            self._mark_needed = True                    # this post reads slots a later load may overwrite
        seq.phase = "post"

    @_guarded
    def launch_post_streamed(self, layer: int) -> None:
        """post[layer] of a streamed step before its route is read: every expert of the layer is in the cache or
        the layer's (closed) stream buffer, so the slot table needs no route and the device groups the rows itself;
        poll_route(layer) then gives the route (pre[layer] rang before post[layer] ran, and pre[layer + 1], which
        overwrites the doorbell, is launched only after it)."""
        seq = self._seq_of_step("launch_post_streamed")
        self._check_seq(seq, "launch_post_streamed", "pre", layer=layer)
        s = self._stream[layer % 2] if self.n_stream else None
        if self.cur.T < 2 or s is None or s["layer"] != layer or s["open"]:
            raise BackendError(f"launch_post_streamed: layer {layer} has no closed stream in this step")
        slot_of = self._slots[layer].copy()
        for e, slot in s["slots"].items():
            slot_of[e] = slot
        lost = np.flatnonzero(slot_of < 0)
        if lost.size:
            raise BackendError(f"launch_post_streamed: experts {lost[:8].tolist()} of layer {layer} are in no cache "
                               f"slot and were not streamed")
        self._loads_before_post()
        self.ev_m[layer].record(self.stream)             # post[layer] runs after its experts' copies
        self.stream.wait(self.ev_s1[layer])
        self.batch.stage_post(layer, slot_of)
        self.batch.copy_routes(layer)
        self.batch.run("post", self.batch.bucket(self.cur.T), layer)
        self._mark_needed = True
        self.ev_post_done[layer % 2].record(self.stream)
        self.ev_p1[layer].record(self.stream)
        self._posted = layer
        seq.phase = "streamed"

    @_guarded
    def post_done(self, layer: int) -> bool:
        """Whether post[layer] of the streamed step in flight has run on the device (never blocks)."""
        if self._posted < layer:
            raise BackendError(f"post_done({layer}): post[{layer}] of a streamed step is not launched")
        return self.ev_p1[layer].query("post[%d]", layer)

    @_guarded
    def streamed_routes(self) -> np.ndarray:
        """After a streamed step's head: every streamed layer's routed experts (n_layer, T, k) int32, copied back
        per layer beside the posts; a view valid until the next step begins."""
        seq = self._seq_of_step("streamed_routes")
        self._check_seq(seq, "streamed_routes", "idle", "head")
        if not self.ev_head.query("head"):
            raise BackendError("streamed_routes: the step's head has not run")
        return self.batch.routes_stage[:, :self.cur.T]

    def _post_rows(self, seq: _Seq, plan: ExpertPlan) -> None:
        """post[plan.layer] of a batched step that did not stream (split): in host mode the slot table of the
        layer's resident experts and the host's parts of the others go first."""
        layer, cfg = plan.layer, self.cfg
        if self.experts == "vram":
            if not plan.resident.all():
                raise BackendError("launch_post: experts='vram' computes every routed expert; the plan says the "
                                   "host computed some")
        else:
            s = self._stream[layer % 2] if self.n_stream else None
            if s is not None and s["layer"] == layer:
                raise BackendError(f"launch_post: layer {layer} streamed its experts in this step (its post is "
                                   f"launch_post_streamed)")
            slot_of = np.full(cfg.n_expert, -1, I32)
            res = plan.experts[plan.resident]
            slot_of[res] = self._slots[layer, res]
            lost = res[slot_of[res] < 0]
            if lost.size:
                raise BackendError(f"launch_post: expert {int(lost[0])} of layer {layer} is marked resident but is "
                                   f"in no cache slot")
            self._loads_before_post()
            self.batch.stage_post(layer, slot_of, plan.parts, plan.mask)
        self.batch.run("post", self.batch.bucket(self.cur.T), layer)
        if self.experts == "host":
            self._mark_needed = True
        seq.phase = "post"

    @_guarded
    def launch_head(self) -> None:
        seq = self._seq_of_step("launch_head")
        self._check_seq(seq, "launch_head", "post", "streamed", layer=self.cfg.n_layer - 1)
        if self.cur.T > 1:
            n = len(self.cur.logit_rows)
            if n:
                self.batch.run_head()
                self.batch.copy_logits(n)
            self.ev_head.record(self.stream)
            seq.phase = "head"
            return
        self._run("head", self._enq_head)
        self.ev_head.record(self.stream)
        seq.phase = "head"

    @_guarded
    def launch_whole(self, step: Step, e: np.ndarray | None) -> None:
        """The whole step as one graph (experts='vram' only, no doorbell wait), e its PLE rows (T, ple_dim);
        poll_logits gives its logits. A step of several rows runs its bucket's batched graph, then the head."""
        seq = self._step_seq(step, "launch_whole")
        mapped = self.experts == "host" and self.mapped and step.T == 1
        if not (self.experts == "vram" or mapped) or not self.graphs or seq.dump is not None:
            raise BackendError("launch_whole: the whole-step graph needs experts='vram' (or a one-row step with the "
                               "experts mapped: map_experts), graphs=True and no dump")
        self._check_seq(seq, "launch_whole", "idle")
        if step.T > 1:                  # the bucket's whole-step graph, then the head on the logit rows
            self._stage_rows(seq, step, "launch_whole")
            if self.cfg.ple_layers:
                if e is None:
                    raise BackendError("launch_whole: the model's PLE layer needs the step's PLE rows")
                self._stage_ple(seq, np.asarray(e, F32).reshape(step.T, -1), step.T, "launch_whole")
            self.batch.run("whole", self.batch.bucket(step.T))
            if len(step.logit_rows):
                self.batch.run_head()
                self.batch.copy_logits(len(step.logit_rows))
            self.ev_head.record(self.stream)
            seq.phase, seq.layer = "head", self.cfg.n_layer - 1
            return
        self._stage_token(seq, int(step.tokens[0]), None if e is None else np.asarray(e).reshape(-1),
                          "launch_whole")
        if self.cfg.ple_layers and not seq.ple_ready:
            raise BackendError("launch_whole: the model's PLE layer needs the row's PLE vector")
        if mapped:
            self._harvest_promotions()
            self._sync_ptab(mark=self.ev_tok[0])
            self._tok_eff = self._eff.copy()
            self.ev_tok[1].record(self.stream)
        self._g["token"].launch(self.stream)
        if mapped:
            self.ev_tok[2].record(self.stream)
            self._mark_needed = True        # its kernels read cache slots a later load may overwrite
        self.ev_head.record(self.stream)
        seq.phase, seq.layer = "head", self.cfg.n_layer - 1

    @_guarded
    def poll_logits(self) -> np.ndarray | None:
        """The step's logit rows (0 or 1, n_vocab), once the head has run."""
        seq = self._seq_of_step("poll_logits")
        self._check_seq(seq, "poll_logits", "head")
        if not self.ev_head.query("head"):
            return None
        T, n = self.cur.T, len(self.cur.logit_rows)
        if T > 1:
            out = self.batch.logits_out[:n].copy()
        else:
            out = self.logits.copy()[None] if n else np.zeros((0, self.cfg.n_vocab), F32)
            if seq.dump is not None:
                seq.dump.put(seq.pos, -1, "logits", out[0] if n else self.logits.copy())
        seq.pos += T
        self._ring += self.cfg.n_layer
        seq.phase, seq.layer = "idle", -1
        return out

    # ---- measurement helpers (bench/gpu_check.py) ----------------------------------------------------------
    def stage_graphs(self) -> list[tuple[str, Graph]]:
        """One graph per stage of a whole token (experts='vram'): labels 'begin', 'gdn:mixer', 'qsa:route', ...
        Launched back to back with events between them, their times add up to that run's total."""
        if self.experts != "vram":
            raise BackendError("stage_graphs: a whole token without the host needs experts='vram'")
        if "stages" not in self._g:
            g: list[tuple[str, Graph]] = [("begin", Graph("stage begin", self.stream, self._enq_begin))]
            for il in range(self.cfg.n_layer):
                kind = "gdn" if self.cfg.recurrent[il] else "qsa"
                for name, launches in self.pre_tok[il] + self.post[il]:
                    g.append((f"{kind}:{name}", Graph(f"stage {il}.{name}", self.stream,
                                                      lambda ls=launches: [x.enqueue(self.stream) for x in ls])))
            g.append(("head", Graph("stage head", self.stream, self._enq_head)))
            self._g["stages"] = g
        return self._g["stages"]

    @_guarded
    def timed_token(self, seq: _Seq, token: int, ple_e: np.ndarray | None) -> list[tuple[str, float]]:
        """Decode one token through stage_graphs() with an event between every two launches: [(label, ms)] whose
        sum is this run's total (one stage graph per launch adds the gaps the whole-token graph does not have).
        Synchronizes at the end: measurement only."""
        self._check_seq(seq, "timed_token", "idle")
        graphs = self.stage_graphs()
        self._stage_token(seq, token, ple_e, "timed_token")
        evs = [drv.Event(timing=True) for _ in range(len(graphs) + 1)]
        try:
            evs[0].record(self.stream)
            for (_, g), ev in zip(graphs, evs[1:]):
                g.launch(self.stream)
                ev.record(self.stream)
            evs[-1].synchronize("timed_token")
            out = [(label, evs[i + 1].elapsed_ms(evs[i])) for i, (label, _) in enumerate(graphs)]
        finally:
            for ev in evs:
                ev.destroy()
        seq.pos += 1
        self._ring += self.cfg.n_layer
        return out

    @_guarded
    def timed_step(self, step: Step, e: np.ndarray | None, per_launch: bool = False) -> list[tuple[str, float]]:
        """A batched step (experts='vram') stage by stage (per_launch: launch by launch) with events between them:
        [(label, ms)] whose sum is this run's total (bench/bench_prefill_gpu.py). Synchronizes: measurement only."""
        seq = self._step_seq(step, "timed_step")
        if step.T < 2 or self.experts != "vram":
            raise BackendError("timed_step: a batched step (T > 1) with experts='vram'")
        self._check_seq(seq, "timed_step", "idle")
        self._stage_rows(seq, step, "timed_step")
        if self.cfg.ple_layers:
            self._stage_ple(seq, np.asarray(e, F32).reshape(step.T, -1), step.T, "timed_step")
        out = self.batch.timed(self.batch.bucket(step.T), per_launch)
        seq.pos += step.T
        self._ring += self.cfg.n_layer
        return out

    def measure_doorbell(self, n: int = 200) -> np.ndarray:
        """Seconds from cuGraphLaunch to the host seeing the ring, n times, for a graph of the step copy and
        layer 0's router kernel (the doorbell alone, not the layer before it). Between tokens only."""
        if self.seq is not None and self.seq.live and self.seq.phase != "idle":
            raise BackendError("measure_doorbell: a token is in flight")
        route = self.pre[0][[name for name, _ in self.pre[0]].index("route")][1][-1]
        g = Graph("doorbell probe", self.stream,
                  lambda: (self.step_copy.enqueue(self.stream), route.enqueue(self.stream)))
        ev, out = drv.Event(), []
        try:
            for _ in range(n):
                if self._ring + self.cfg.n_layer >= 2**31:
                    self._ring = 1
                want = self._ring
                self._ring += self.cfg.n_layer
                self.step[STEP_RING] = want
                t0 = time.perf_counter()
                g.launch(self.stream)
                ev.record(self.stream)
                while self.db.value() != want:
                    if ev.query("doorbell probe") and self.db.value() != want:
                        raise BackendError(f"measure_doorbell: the probe finished without ringing {want}")
                out.append(time.perf_counter() - t0)
                self.stream.synchronize("doorbell probe")
        finally:
            g.destroy()
            ev.destroy()
        return np.array(out)

    def close(self) -> None:
        if getattr(self, "_closed", False):             # the scheduler closes its backend; so may its owner
            return
        self._closed = True
        if getattr(self, "_copies", None) is not None:
            self._copies = drv.CopyBatch(self.side)     # queued copies never run: their cells are freed below
        try:
            self.stream.synchronize("close")
            self.side.synchronize("close")          # uploads and streamed copies read the pinned cells freed below
        finally:
            for g in self._g.values():
                for x in (g if isinstance(g, list) else [("", g)]):
                    x[1].destroy()
            self._g = {}
            self.A.free()
            for b in (self.h_step, self.h_ple, self.h_post, self.h_logits):
                b.free()
            if self.batch is not None:
                self.batch.destroy()
                self.batch.free_host()
            self.db.free()
            if self.experts == "host":
                for b in self.h_load:
                    b.free()
                if self.can_map:
                    self.h_ptab.free()
                    self.h_ids_all.free()
                    if self.prefetch:
                        self.h_pred.free()
                self._map_refs = []
                self._inflight = []
                self.cells.close(lambda h: h.free())
            self.stream.destroy()
            self.side.destroy()
            self.branch.destroy()
            self.branch2.destroy()
