"""moe.cu's wrappers: the router with the doorbell, the resident experts (gate/up GLU, down), and the combine
that ends post[l] (gr_write plus the next read's norm)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.config import ModelConfig
from strata.cuda.arena import DevArray, DevMat
from strata.cuda.launch import F, I, Launch, P, need
from strata.kernels.build import define
from strata.kernels.gemv import CTA_THREADS, KERNEL_TYPES, device_row_bytes, geometry, tile_smem, xq_bytes
from strata.kernels.hc import MAX_HC, own_elements

MAX_EXPERTS = 1024      # one router thread per expert
MAX_USED = 64           # pk[] in moe_route

# struct MoeJob (moe.cu), 104 bytes
MOE_JOB_DTYPE = np.dtype([("g_base", "<u8"), ("u_base", "<u8"), ("d_base", "<u8"), ("g_stride", "<i8"),
                          ("u_stride", "<i8"), ("d_stride", "<i8"), ("type_g", "<i4"), ("type_u", "<i4"),
                          ("type_d", "<i4"), ("rb_g", "<i4"), ("rb_u", "<i4"), ("rb_d", "<i4"), ("E", "<i4"),
                          ("F", "<i4"), ("Fp", "<i4"), ("geom_gu", "<i4"), ("geom_d", "<i4"), ("fetched", "<i4"),
                          ("ptab", "<u8")])
assert MOE_JOB_DTYPE.itemsize == 104


def padded_ff(cfg: ModelConfig) -> int:
    """Row stride of the experts' hidden activations h (k, Fp): 16-byte aligned rows for the down GEMV."""
    return (cfg.n_ff_exp + 7) // 8 * 8


def route_launch(fn, name: str, cfg: ModelConfig, layer: int, logits: DevArray, x: DevArray, ids: DevArray,
                 wts: DevArray, step: DevArray, db: "DoorbellPtrs | None", ticket: DevArray,
                 rows: int = 1, k: int | None = None) -> Launch:
    """Top-k routing of the step's rows (up to `rows`); with `db` the payload and the ring go to the doorbell's
    mapped memory, rung by the last row's CTA (ticket: a zeroed u32 word the kernel leaves zeroed). k: the
    experts kept a row (the model's top k by default; a prediction may keep more)."""
    n, E = cfg.n_expert, cfg.n_embd
    k = cfg.n_expert_used if k is None else int(k)
    if n > MAX_EXPERTS or k > MAX_USED:
        raise ValueError(f"{name}: {n} experts top-{k}; the router kernel takes <= {MAX_EXPERTS} top-<= {MAX_USED}")
    need(logits, name + " logits", rows * n)
    need(x, name + " x", rows * E)
    need(ids, name + " ids", rows * k, np.int32)
    need(wts, name + " weights", rows * k)
    need(step, name + " step", 8, np.int32)
    need(ticket, name + " ticket", 1, np.uint32)
    d = db or DoorbellPtrs(0, 0, 0, 0)
    return Launch(fn, name, (rows,), (max(32, (n + 31) // 32 * 32),), 0,
                  [P(logits), P(x), P(ids), P(wts), P(d.x), P(d.ids), P(d.wts), P(d.seq), P(step), I(layer), I(n),
                   I(k), I(E), P(ticket)])


@dataclass(frozen=True)
class DoorbellPtrs:
    """Device addresses of the doorbell's mapped pinned fields (0: no doorbell)."""
    x: int
    ids: int
    wts: int
    seq: int


@dataclass
class ExpertBank:
    """Where expert slot s's matrices start: base + s * stride for gate, up and down (one DevMat each, n_mat slots)."""
    gate: DevMat
    gate_off: int
    up: DevMat
    up_off: int
    down: DevMat
    down_off: int
    stride: tuple[int, int, int]      # bytes between slots: gate, up, down


def expert_geometry(cfg: ModelConfig, bank: ExpertBank):
    """(gate/up geometry, down geometry): k experts' rows together set the parallelism."""
    E, Fn, k = cfg.n_embd, cfg.n_ff_exp, cfg.n_expert_used
    g, u, d = bank.gate, bank.up, bank.down
    qt = g.qtype if g.row_bytes >= u.row_bytes else u.qtype
    gu = geometry(qt, E, Fn * k, max(g.row_bytes, u.row_bytes), halves=2)
    dn = geometry(d.qtype, Fn, E * k, d.row_bytes)
    return gu, dn


def moe_job_row(cfg: ModelConfig, bank: ExpertBank, ptab: int = 0, fetched: bool = False) -> np.ndarray:
    """ptab: the device address of the layer's (n_expert, 3) table of expert part addresses (a mapped token's
    one-row kernels: slots are then expert ids), or with `fetched` of moe_fetch's (k, 3) table of the selected
    experts' parts, every one in VRAM; 0: base + slot * stride."""
    E, Fn = cfg.n_embd, cfg.n_ff_exp
    g, u, d = bank.gate, bank.up, bank.down
    for m, n_out, n_in, what in ((g, Fn, E, "gate"), (u, Fn, E, "up"), (d, E, Fn, "down")):
        if (m.n_out, m.n_in) != (n_out, n_in) or m.qtype not in KERNEL_TYPES or \
                m.row_bytes != device_row_bytes(m.qtype, n_in):
            raise ValueError(f"experts: {what} '{m.buf.name}' is {m.n_out}x{m.n_in} type {m.qtype}, needs "
                             f"{n_out}x{n_in} in a kernel format")
    r = np.zeros(1, MOE_JOB_DTYPE)
    r["g_base"], r["u_base"], r["d_base"] = g.ptr + bank.gate_off, u.ptr + bank.up_off, d.ptr + bank.down_off
    r["g_stride"], r["u_stride"], r["d_stride"] = bank.stride
    r["type_g"], r["type_u"], r["type_d"] = g.qtype, u.qtype, d.qtype
    r["rb_g"], r["rb_u"], r["rb_d"] = g.row_bytes, u.row_bytes, d.row_bytes
    r["E"], r["F"], r["Fp"] = E, Fn, padded_ff(cfg)
    gu, dn = expert_geometry(cfg, bank)
    r["geom_gu"], r["geom_d"] = gu.word, dn.word
    r["ptab"] = ptab
    r["fetched"] = int(fetched)
    return r


def expert_launches(fn_gate_up, fn_down, name: str, cfg: ModelConfig, job: DevArray, bank: ExpertBank,
                    slots: DevArray, x: DevArray, h: DevArray, out: DevArray,
                    ptab: DevArray | None = None, fetched: bool = False) -> tuple[Launch, Launch]:
    """Uploads the layer's MoeJob into `job` and returns (gate/up GLU, down) over the k selected experts.
    ptab: the layer's (n_expert, 3) uint64 table of part addresses (slots are then the routed expert ids); with
    `fetched`, moe_fetch's (k, 3) table of the selected experts' parts in VRAM instead."""
    k, E, Fn = cfg.n_expert_used, cfg.n_embd, cfg.n_ff_exp
    if ptab is not None:
        need(ptab, name + " address table", 3 * (k if fetched else cfg.n_expert), np.uint64)
    elif fetched:
        raise ValueError(f"{name}: fetched experts need moe_fetch's table")
    row = moe_job_row(cfg, bank, 0 if ptab is None else ptab.ptr, fetched)
    need(job, name + " job", MOE_JOB_DTYPE.itemsize, np.uint8)
    need(slots, name + " slots", k, np.int32)
    need(x, name + " x", E)
    need(h, name + " h", k * padded_ff(cfg))
    need(out, name + " out", k * E)
    job.upload(row.view(np.uint8))
    gu, dn = expert_geometry(cfg, bank)
    rg, rd = min(gu.rows, Fn), min(dn.rows, E)
    # x's integer limbs after each tile (moe.cu: the layout the gate's format, and the down's, reads)
    smem_gu = tile_smem(rg * bank.gate.row_bytes, rg * bank.up.row_bytes) + xq_bytes(bank.gate.qtype, E, (1, 2))
    smem_d = tile_smem(rd * bank.down.row_bytes) + xq_bytes(bank.down.qtype, Fn, (1, 2))
    gul = Launch(fn_gate_up, name + ".gate_up", (-(-Fn // gu.rows), k), (CTA_THREADS,), smem_gu,
                 [P(job), P(slots), P(x), P(h)])
    dnl = Launch(fn_down, name + ".down", (-(-E // dn.rows), k), (CTA_THREADS,), smem_d,
                 [P(job), P(slots), P(h), P(out)])
    return gul, dnl


@dataclass(frozen=True)
class FetchLayout:
    """moe_fetch's staging: k slots of `stride` bytes, a selected expert's gate, up and down parts at 0, off_u and
    off_d; n_g, n_u, n_d each part's bytes (a part lands at its offset plus its source address mod 16)."""
    n_g: int
    n_u: int
    n_d: int

    @property
    def off_u(self) -> int:
        return _room(self.n_g)

    @property
    def off_d(self) -> int:
        return self.off_u + _room(self.n_u)

    @property
    def stride(self) -> int:
        return self.off_d + _room(self.n_d)


def _room(n: int) -> int:
    """A part's staging bytes: its 16-byte chunks from any source alignment (n + 30 at most), 256-aligned."""
    return (n + 32 + 255) // 256 * 256


def fetch_table(ptab: np.ndarray, ids: np.ndarray, dev_lo: int, dev_hi: int, layout: FetchLayout,
                stage: int, pre_ids: np.ndarray | None = None,
                pre_eff: np.ndarray | None = None) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """What moe_fetch does, in numpy: (eff (k, 3) uint64, the copies [(16-aligned source, staging offset,
    bytes)]) for a layer's table ptab (n_expert, 3), its routed ids (k) and the staging at device address `stage`.
    pre_ids (n) / pre_eff (n, 3): a prefetch's ids and its own eff (n may differ from k: a prediction may keep more
    experts than the route); a miss among them is not copied again."""
    eff, copies = np.zeros((len(ids), 3), np.uint64), []
    sizes, offs = (layout.n_g, layout.n_u, layout.n_d), (0, layout.off_u, layout.off_d)
    pre = [] if pre_ids is None else np.asarray(pre_ids).tolist()
    for j, e in enumerate(np.asarray(ids).tolist()):
        host = not dev_lo <= int(ptab[e, 0]) < dev_hi
        m = pre.index(e) if host and e in pre else -1
        for p in range(3):
            s = int(ptab[e, p])
            d = j * layout.stride + offs[p]
            if m >= 0:
                eff[j, p] = pre_eff[m, p]
                continue
            if host:
                lo, hi = s & ~15, (s + sizes[p] + 15) & ~15
                copies.append((lo, d, hi - lo))
            eff[j, p] = stage + d + (s & 15) if host else s
    return eff, copies


def prefetch_stats(ids: np.ndarray, resident: np.ndarray, preds: np.ndarray, pred_resident: np.ndarray,
                   part_bytes: list[int]) -> tuple[int, int, int, int]:
    """A mapped token's prefetch, counted over layers 1 .. n-1 (layer l's prediction is made beside layer l - 1):
    (misses: routed experts not in VRAM, of them predicted, predicted experts not in VRAM (the ones prefetched),
    their bytes). ids, resident: (n_layer, k); preds, pred_resident: (n_layer, k or more: the prediction's width);
    part_bytes: an expert's bytes per layer.
    Vectorized: it runs on the host between two tokens."""
    miss = ~resident[1:]
    predicted = (ids[1:, :, None] == preds[1:, None, :]).any(axis=2)
    fetched = (~pred_resident[1:]).sum(axis=1)
    return (int(miss.sum()), int((miss & predicted).sum()), int(fetched.sum()),
            int(fetched @ np.asarray(part_bytes[1:], np.int64)))


def fetch_launch(fn, name: str, cfg: ModelConfig, ptab: DevArray, ids: DevArray, eff: DevArray, stage: DevArray,
                 layout: FetchLayout, dev_lo: int, dev_hi: int, n_cta: int,
                 pre: tuple[DevArray, DevArray] | None = None, k: int | None = None) -> Launch:
    """A mapped token's misses of one layer into VRAM staging (moe.cu moe_fetch): the selected experts ids (k:
    the model's top k unless given, a prefetch's prediction may hold more) whose ptab entries lie outside
    [dev_lo, dev_hi) are copied by n_cta CTAs; eff (k, 3) gets every selection's part addresses for
    expert_launches(fetched=True). pre = (ids (n), eff (n, 3)) of a prefetch of the layer (this kernel run
    earlier on n predicted ids into another staging): misses among them are taken from there."""
    k = cfg.n_expert_used if k is None else int(k)
    if not 1 <= k <= MAX_USED:
        raise ValueError(f"{name}: {k} experts; moe_fetch takes 1 .. {MAX_USED}")
    n_pre = 0 if pre is None else pre[0].size
    if n_pre > MAX_USED:
        raise ValueError(f"{name}: a prefetch of {n_pre} experts; moe_fetch takes <= {MAX_USED}")
    need(ptab, name + " address table", 3 * cfg.n_expert, np.uint64)
    need(ids, name + " ids", k, np.int32)
    need(eff, name + " fetched table", 3 * k, np.uint64)
    need(stage, name + " staging", k * layout.stride, np.uint8)
    if pre is not None:
        need(pre[0], name + " prefetched ids", n_pre, np.int32)
        need(pre[1], name + " prefetched table", 3 * n_pre, np.uint64)
    return Launch(fn, name, (int(n_cta),), (CTA_THREADS,), 0,
                  [P(ptab), P(ids), P(eff), P(stage), P(int(dev_lo)), P(int(dev_hi)), I(k), I(layout.stride),
                   I(layout.n_g), I(layout.n_u), I(layout.n_d), I(layout.off_u), I(layout.off_d),
                   P(None if pre is None else pre[0]), P(None if pre is None else pre[1]), I(n_pre)])


def combine_launch(fn, name: str, cfg: ModelConfig, wts: DevArray, slots: DevArray, gpu_parts: DevArray,
                   host_parts: DevArray, shared: DevArray, sg: DevArray, inj_raw: DevArray, R: DevArray,
                   comb: DevArray, w_next: DevArray, xn: DevArray) -> Launch:
    k, E, hc = cfg.n_expert_used, cfg.n_embd, cfg.hc
    own_elements(name, E)
    need(wts, name + " weights", k)
    need(slots, name + " slots", k, np.int32)
    need(gpu_parts, name + " GPU parts", k * E)
    need(host_parts, name + " host parts", k * E)
    need(shared, name + " shared", E)
    need(sg, name + " shared gate", 1)
    need(inj_raw, name + " inject", hc)
    for a, what in ((R, "R"), (w_next, "next norm"), (xn, "xn")):
        need(a, f"{name} {what}", hc * E)
    need(comb, name + " comb", E)
    return Launch(fn, name, (hc,), (1024,), 0,
                  [P(wts), P(slots), P(gpu_parts), P(host_parts), P(shared), P(sg), P(inj_raw), P(R), P(comb),
                   P(w_next), P(xn), I(k), I(E), I(hc), F(cfg.rms_eps)])


# ---- the batched step: pairs grouped by expert on the device, the grouped GEMMs, the combine over rows --------

# MOE_WIDE_PAIRS: the mean pairs an expert at which a step's expert tiles take 128 pairs (moe.cu's 64 x 128 tiles,
# gate/up as gemm.cuh's paired GLU tile: each weight decoded once per 128 pairs instead of once per 64) instead of 64.
# A build define so that a same-call comparison can move it (a large value keeps every step at 64).
WIDE_PAIRS = define("MOE_WIDE_PAIRS", 64)
# MOE_NARROW_LAST=1: with 128-pair tiles, an expert's last tile of at most 64 pairs is a 64-pair tile instead (moe.cu
# moe_group's second list). Calibrated routing spreads a 4096-row chunk's pairs from 0 to ~570 an expert (median
# ~53): 128-pair tiles alone cost 39% more multiplies than 64-pair ones there, 64-pair tiles alone decode the hot
# experts' weights 2-9 times; the two lists decode no more than the first and multiply no more than the second.
NARROW_LAST = define("MOE_NARROW_LAST", 1)


@dataclass(frozen=True)
class TilePlan:
    """A step's expert tiles (moe.cu moe_group): tiles of `bn` pairs in the first list (at most `cap`), and with
    `bn2` > 0 an expert's last tile of at most bn2 pairs in a second list of bn2-pair tiles (at most `cap2`)."""
    bn: int
    cap: int
    bn2: int = 0
    cap2: int = 0

    @property
    def plane_rows(self) -> int:
        """The rows of the tiles' split planes (gemm.py XPREP): the first list's tile i at i bn, the second's after."""
        return self.cap * self.bn + self.cap2 * self.bn2

    def tile_counts(self, pairs: np.ndarray) -> list[int]:
        """moe_group's rule in numpy: the tiles each list gets for these pairs per expert."""
        r = pairs % self.bn
        return [int((pairs // self.bn + (r > self.bn2)).sum()), int(((r > 0) & (r <= self.bn2)).sum())]

    @property
    def lists(self) -> tuple[tuple[int, int, int], ...]:
        """(pairs a tile, the list's first tile in the tile table, its capacity) per list."""
        return ((self.bn, 0, self.cap),) + (((self.bn2, self.cap, self.cap2),) if self.bn2 else ())


def tile_plan(max_rows: int, k: int, n_expert: int) -> TilePlan:
    """Pairs per expert tile: 16 while the step's pairs per expert are few, 64 for longer steps, 128 for long chunks
    (WIDE_PAIRS pairs an expert on average), their last tiles of <= 64 pairs at 64 (NARROW_LAST). Capacities: every
    used expert's partial tile plus the full ones; with two lists a first-list tile holds > bn2 pairs."""
    pairs = max_rows * k
    bn = 16 if pairs <= 16 * n_expert else 128 if pairs >= WIDE_PAIRS * n_expert else 64
    cap = min(n_expert, pairs) + pairs // bn
    if bn == 128 and NARROW_LAST:
        return TilePlan(bn, min(cap, pairs // 65), 64, min(n_expert, pairs))
    return TilePlan(bn, cap)


def group_launch(fn, name: str, cfg: ModelConfig, ids: DevArray, slot_of: DevArray | None, step: DevArray,
                 pair_tok: DevArray, pair_of: DevArray, tiles: DevArray, n_tiles: DevArray, rows: int,
                 plan: TilePlan) -> Launch:
    """The step's pairs grouped by expert (slot_of: the layer's VRAM slot per expert, -1 on the host; None: all
    resident, slot = expert id) and cut into the plan's tiles: tiles (4 (cap + cap2)), n_tiles (2: each list's)."""
    n, k = cfg.n_expert, cfg.n_expert_used
    if n > MAX_EXPERTS:
        raise ValueError(f"{name}: {n} experts; the grouping kernel takes <= {MAX_EXPERTS}")
    need(ids, name + " ids", rows * k, np.int32)
    if slot_of is not None:
        need(slot_of, name + " slot table", n, np.int32)
    need(step, name + " step", 8, np.int32)
    need(pair_tok, name + " pair rows", rows * k, np.int32)
    need(pair_of, name + " pair of", rows * k, np.int32)
    need(tiles, name + " tiles", 4 * (plan.cap + plan.cap2), np.int32)
    need(n_tiles, name + " tile counts", 2, np.int32)
    return Launch(fn, name, (1,), (1024,), 0,
                  [P(ids), P(slot_of), P(step), P(pair_tok), P(pair_of), P(tiles), P(n_tiles), I(n), I(k),
                   I(plan.bn), I(plan.bn2), I(plan.cap)])


def split_plan(cfg: ModelConfig, bank: ExpertBank, plan: TilePlan) -> tuple[tuple[int, int, int], ...]:
    """The x_split buffers a step's expert tiles take (gemm.py XPREP): (n_in, k-chunk, plane rows) for the gate/up
    input and the down input; each tile's rows at its plane row (TilePlan.plane_rows)."""
    from strata.kernels.gemm import chunk_k
    nr = plan.plane_rows
    return ((cfg.n_embd, chunk_k([bank.gate.qtype, bank.up.qtype]), nr), (cfg.n_ff_exp, chunk_k([bank.down.qtype]), nr))


def grouped_launches(fn_of, name: str, cfg: ModelConfig, job: DevArray, bank: ExpertBank, tiles: DevArray,
                     n_tiles: DevArray, x: DevArray, pair_tok: DevArray, h: DevArray, out: DevArray, rows: int,
                     plan: TilePlan, splits=None, arch: int = 0) -> tuple[Launch, ...]:
    """The gate/up GLU launches, then the down launches, over the step's expert tiles, one of each per tile list of
    the plan; uploads the layer's MoeJob into `job`. x (rows, E), h (pairs, Fp), out (pairs, E); fn_of(kernel name)
    -> the function. splits: gemm.py XSplit buffers for the two inputs (split_plan's): then each GEMM's tiles read
    their rows split once by moe_split launches ahead of it (splits, gate/ups, splits, downs). arch: the device's
    (gemm.py compact_tile: the tiles' shared memory)."""
    from strata.kernels.gemm import compact_tile, smem_bytes, tile_bm, xsplit_bytes
    k, E, Fn, Fp = cfg.n_expert_used, cfg.n_embd, cfg.n_ff_exp, padded_ff(cfg)
    row = moe_job_row(cfg, bank)
    need(job, name + " job", MOE_JOB_DTYPE.itemsize, np.uint8)
    need(x, name + " x", rows * E)
    need(pair_tok, name + " pair rows", rows * k, np.int32)
    need(h, name + " h", rows * k * Fp)
    need(out, name + " out", rows * k * E)
    need(tiles, name + " tiles", 4 * (plan.cap + plan.cap2), np.int32)
    need(n_tiles, name + " tile counts", 2, np.int32)
    job.upload(row.view(np.uint8))
    sp_plan = split_plan(cfg, bank, plan)
    (_, kg, _), (_, kd, _) = sp_plan                    # the two GEMMs' k-chunks
    xs_gu, xs_dn = splits if splits is not None else (None, None)
    for xs, (n_in, bk, nr) in zip((xs_gu, xs_dn), sp_plan):
        if xs is None:
            continue
        if (xs.n_in, xs.bk) != (n_in, bk) or xs.max_rows < nr:
            raise ValueError(f"{name}: a split of {xs.n_in} inputs in chunks of {xs.bk} for {xs.max_rows} rows; the "
                             f"tiles need {n_in}, {bk}, {nr}")
        need(xs.buf, name + " split", xsplit_bytes(n_in, bk, xs.max_rows), np.uint8)
    sp = lambda xs: (P(xs.buf), I(xs.rows)) if xs is not None else (P(None), I(0))
    cgu, cdn = compact_tile(arch, [bank.gate.qtype, bank.up.qtype]), compact_tile(arch, [bank.down.qtype])

    def one_list(bn: int, first: int, cap: int) -> tuple[Launch | None, Launch, Launch | None, Launch]:
        """A tile list's (gate/up split, gate/up, down split, down); the splits None without splits."""
        sfx = "" if first == 0 else f".{bn}"
        tl = tiles.view(f"list{first}", 16 * first, (4 * cap,), np.int32)
        nl = n_tiles.view(f"count{first}", 4 if first else 0, (1,), np.int32)
        bg, bd = tile_bm(bn, True), tile_bm(bn, False)  # moe.cu's tile heights (its down tiles: always the wide ones)
        pair = bn == 128    # the gate/up tiles: paired GLU (one accumulator set), bg / 2 outputs a CTA (moe.cu)
        gu = Launch(fn_of(f"moe_gu{bn}_k{kg}"), name + ".gate_up" + sfx, (-(-Fn // (bg // 2 if pair else bg)), cap),
                    (128,), smem_bytes(kg, bn, bg, not pair, cgu), [P(job), P(tl), P(nl), P(x), P(pair_tok), P(h),
                                                                    *sp(xs_gu)])
        dn = Launch(fn_of(f"moe_down{bn}_k{kd}"), name + ".down" + sfx, (-(-E // bd), cap), (128,),
                    smem_bytes(kd, bn, bd, False, cdn), [P(job), P(tl), P(nl), P(h), P(out), *sp(xs_dn)])

        def split(xs, src: DevArray, ld: int, xrow: DevArray | None, what: str) -> Launch:
            return Launch(fn_of(f"moe_split{bn}_k{xs.bk}"), f"{name}.{what}_split{sfx}", (cap, -(-xs.n_in // xs.bk)),
                          (128,), 0, [P(tl), P(nl), P(src), I(ld), I(xs.n_in), P(xrow), P(xs.buf), I(xs.rows)])
        if splits is None:
            return None, gu, None, dn
        return split(xs_gu, x, E, pair_tok, "gate_up"), gu, split(xs_dn, h, Fp, None, "down"), dn

    split_gu, gus, split_dn, dns = zip(*(one_list(*lst) for lst in plan.lists))
    if splits is None:
        return (*gus, *dns)
    return (*split_gu, *gus, *split_dn, *dns)


def combine_rows_launch(fn, name: str, cfg: ModelConfig, wts: DevArray, pair_of: DevArray, gpu_out: DevArray,
                        host_parts: DevArray, shared: DevArray, sg: DevArray, inj_raw: DevArray, R: DevArray,
                        comb: DevArray, w_next: DevArray, xn: DevArray, step: DevArray, rows: int) -> Launch:
    k, E, hc = cfg.n_expert_used, cfg.n_embd, cfg.hc
    need(wts, name + " weights", rows * k)
    need(pair_of, name + " pair of", rows * k, np.int32)
    need(gpu_out, name + " GPU parts", rows * k * E)
    need(host_parts, name + " host parts", rows * k * E)
    need(shared, name + " shared", rows * E)
    need(sg, name + " shared gate", rows)
    need(inj_raw, name + " inject", rows * hc)
    for a, what in ((R, "R"), (xn, "xn")):
        need(a, f"{name} {what}", rows * hc * E)
    need(w_next, name + " next norm", hc * E)
    need(comb, name + " comb", rows * E)
    need(step, name + " step", 8, np.int32)
    if hc > MAX_HC:
        raise ValueError(f"{name}: {hc} residual streams; combine_rows takes at most {MAX_HC}")
    return Launch(fn, name, (rows,), (1024,), 0,
                  [P(wts), P(pair_of), P(gpu_out), P(host_parts), P(shared), P(sg), P(inj_raw), P(R), P(comb),
                   P(w_next), P(xn), P(step), I(k), I(E), I(hc), F(cfg.rms_eps)])
