"""gemv.cu's wrappers: the job table of a `gemv_jobs` launch, the tile geometry of the GEMV core, and the
embedding lookup.

The block geometry below mirrors quant.cuh's V* format structs (QK elements, BB bytes, NP parts per block). A tile
is RT = (NT / TPG) * RR rows, staged in shared memory and computed by a CTA of NT threads; `geometry` picks TPG
(threads sharing a row) and RR (rows per thread, sharing its x loads) per matrix shape from a small time model.
gemv_jobs runs as many CTAs as the GPU holds at once, each cycling its tiles through GEMV_STAGES buffers so that
the next tiles' copies run under this one's arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.cuda.arena import DevArray, DevMat
from strata.cuda.launch import F, I, Launch, P, need, resident_ctas
from strata.kernels.build import define
from strata.quant.formats import QType, row_bytes

# ggml type -> (elements per block, bytes per block, parts per block), as the V* structs in quant.cuh
BLOCKS: dict[QType, tuple[int, int, int]] = {
    QType.F32: (8, 32, 1), QType.F16: (8, 16, 1), QType.BF16: (8, 16, 1),
    QType.Q4_0: (32, 18, 4), QType.Q4_1: (32, 20, 4), QType.Q5_0: (32, 22, 4), QType.Q5_1: (32, 24, 4),
    QType.Q8_0: (32, 34, 2), QType.Q2_0: (64, 18, 4), QType.IQ4_NL: (32, 18, 4),
    QType.Q2_K: (256, 84, 16), QType.Q3_K: (256, 110, 16), QType.Q4_K: (256, 144, 8), QType.Q5_K: (256, 176, 8),
    QType.Q6_K: (256, 210, 8), QType.IQ4_XS: (256, 136, 8),
}
KERNEL_TYPES = frozenset(BLOCKS)
FLOAT_TYPES = frozenset((QType.F32, QType.F16, QType.BF16))
CTA_THREADS = 256
CTA_WARPS = CTA_THREADS // 32
TILE_MAX = 46 * 1024          # bytes one CTA stages (both matrices of a GLU pair), 16-byte chunks
# gemv_jobs' shared buffers a CTA cycles its tiles through (quant.cuh GEMV_STAGES, >= 2; a bench variant may set it)
GEMV_STAGES = define("GEMV_STAGES", 3)
# gemv_jobs' dynamic shared bytes that keep 2 CTAs a multiprocessor (228 KB; a CTA: 1 KB the system keeps, under
# 1 KB of static arrays, the job table among them)
GEMV_SMEM_MAX = 112 * 1024
GEMV_TILE_MAX = 36 * 1024     # so GEMV_STAGES of gemv_jobs' tiles fit GEMV_SMEM_MAX
GEMV_MAX_JOBS = 8             # gemv.cu GEMV_MAX_JOBS: jobs in one launch
# the formats gemv_jobs takes on the integer path (quant.cuh int_type: x in three 8-bit limbs, dp4a)
INT_TYPES = frozenset((QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS))
# A CTA makes x's limbs once (xq_prep: all of x, n_in elements) and then saves ~1 instruction a weight of the rows it
# computes; a job whose CTAs compute fewer rows than this (a tile's, or its share of the ~2 CTAs a multiprocessor
# the ring runs) takes the f32 path (0: the integer path always). The hc reads' down projection (2 rows of 10240 a
# CTA) made limbs for 4x the weights it read them for. All-VRAM decode on the H100, one call (bench/RESULTS.md
# "ninth session"): 8.09 ms a token at 0, 7.32 at 8, 7.17 at 16, 7.39 at 64, 7.40 with the f32 path everywhere.
GEMV_INT_ROWS = define("GEMV_INT_ROWS", 16)
N_SM = 132                    # the H200's multiprocessors: the time model's parallelism

# instructions per weight of each format's decode + FMA (quant.cuh), for the time model
OPS: dict[QType, float] = {QType.Q2_0: 3.3, QType.Q8_0: 3.6, QType.IQ4_XS: 4.8, QType.Q4_K: 3.9, QType.Q5_K: 4.5,
                           QType.Q6_K: 4.5, QType.F32: 2.0, QType.F16: 2.2, QType.BF16: 2.2}

# struct GemvJob (gemv.cu), 64 bytes
JOB_DTYPE = np.dtype([("w", "<u8"), ("w2", "<u8"), ("x", "<u8"), ("y", "<u8"), ("type", "<i4"), ("type2", "<i4"),
                      ("n_in", "<i4"), ("n_out", "<i4"), ("row_bytes", "<i4"), ("row_bytes2", "<i4"),
                      ("cta0", "<i4"), ("geom", "<i4")])
assert JOB_DTYPE.itemsize == 64


def device_row_bytes(qt: QType, n_in: int) -> int:
    """Bytes of one row on the device: float rows are padded to 8 elements, block rows are the file's."""
    if qt in FLOAT_TYPES:
        return (n_in + 7) // 8 * 8 * (4 if qt == QType.F32 else 2)
    return row_bytes(qt, n_in)


def n_parts(qt: int, n_in: int) -> int:
    qk, _, np_ = BLOCKS[QType(qt)]
    return (n_in + 7) // 8 if QType(qt) in FLOAT_TYPES else n_in // qk * np_


@dataclass(frozen=True)
class Geom:
    tpg: int      # threads per row group (a power of 2, 4 .. nt)
    rr: int       # rows per thread (1 to 4), sharing the thread's x loads
    nt: int       # threads per CTA
    f32: bool = False   # gemv_jobs: the f32 path for this job even where its format has the integer path

    @property
    def groups(self) -> int:
        return self.nt // self.tpg

    @property
    def rows(self) -> int:          # rows per tile
        return self.groups * self.rr

    @property
    def word(self) -> int:          # quant.cuh geom_tpg / geom_rr / geom_f32
        return (self.tpg.bit_length() - 1) | (self.rr << 4) | (int(self.f32) << 7)


def geometry(qt: int, n_in: int, n_out: int, rb: int, *, halves: int = 1, nt: int = CTA_THREADS,
             rr_only: int | None = None, tile_max: int = TILE_MAX, n_sm: int = N_SM) -> Geom:
    """The (TPG, RR) whose estimated time is least: per-CTA latency + staging + the busiest thread's decode work
    + its x loads, times the CTA waves (one resident tile per SM), but never under the bytes at 3.5 TB/s.
    `halves` = 2 for a GLU pair; rr_only fixes RR (up_mix: one row per stream).

    The coefficients are a least-squares fit to every geometry of the five dense flash matrices timed on the H200
    (`bench/gpu_check.py --phases gemv --sweep`, bench/GPU_NOTES.md): a thread's x loads (float4 reads, one per
    4 elements of each part it takes) cost ~40x its decode instructions, so rows per thread (RR, sharing them)
    matter most; the fit's pick was within 2% of the fastest geometry on each of the five. That fit is of the
    kernel that took one tile a CTA, copy then compute; the tile ring (gemv_jobs) keeps the model until a sweep
    of the ring refits it. RR 3 is tried too: the ring's sweep (H100, bench/RESULTS.md "twelfth session") had
    TPG 32, RR 3 fastest on the IQ4_XS in-projections (attn_qkv 16.5 us against 18.3 for the pick before, attn_gate
    11.4 against 13.4), the model now picks it there, and the all-VRAM token went 6.753 -> 6.616 ms."""
    qt = QType(qt)
    np_ = n_parts(qt, n_in)
    epp = 8 if qt in FLOAT_TYPES else BLOCKS[qt][0] * 1 // BLOCKS[qt][2]
    ops = OPS.get(qt, 6.0)
    total = n_out * rb * halves
    best, best_t = None, None
    tpg = 4
    while tpg <= nt:
        for rr in ((rr_only,) if rr_only else (4, 3, 2, 1)):
            g = Geom(tpg, rr, nt)
            tile = min(g.rows, n_out) * rb * halves + 32 * halves
            if tile > tile_max and not (tpg == nt and rr == (rr_only or 1)):
                continue
            x_elems = -(-np_ // tpg) * epp                         # the busiest thread's x elements
            n_tiles = -(-n_out // g.rows)
            t_cta = 0.45 + tile / 10.6e3 + x_elems * rr * ops / 1920.0 + x_elems / 46.8      # us
            t = max(t_cta * max(1.0, n_tiles / n_sm), total / 3.5e6)
            if best_t is None or t < best_t * 0.98:
                best, best_t = g, t
        tpg *= 2
    return best


def warps_per_row(qt: int, n_in: int, n_out: int = 5) -> int:
    """Warps sharing one row in the geometry of an n_out x n_in matrix (1 when a row group fits in a warp)."""
    qt = QType(qt)
    g = geometry(qt, n_in, n_out, device_row_bytes(qt, n_in), tile_max=ring_tile_max(xq_bytes(qt, n_in)))
    return max(1, g.tpg // 32)


@dataclass
class Job:
    """y = w @ x, or y = silu(w @ x) * (w2 @ x) when w2 is set (GLU); `mat` picks one of stacked matrices."""
    w: DevMat
    x: DevArray
    y: DevArray
    w2: DevMat | None = None
    mat: int = 0


def job_table(name: str, n_jobs: int, reserve) -> DevArray:
    """Reserve the device table of a launch of n_jobs jobs (reserve = Arena.reserve)."""
    return reserve(name, (n_jobs * JOB_DTYPE.itemsize,), np.uint8)


def _check_mat(m: DevMat, what: str) -> None:
    if QType(m.qtype) not in KERNEL_TYPES:
        raise ValueError(f"{what}: no GEMV kernel for {QType(m.qtype).name} (convert it at load)")
    if m.row_bytes != device_row_bytes(QType(m.qtype), m.n_in):
        raise ValueError(f"{what}: rows of {m.row_bytes} bytes, {QType(m.qtype).name} x {m.n_in} needs "
                         f"{device_row_bytes(QType(m.qtype), m.n_in)}")


def xq_layout(qt: int) -> int:
    """The x layout the integer path of qt reads (quant.cuh xq_layout): 0 none (the f32 path), 1 natural, 2 permuted
    in 16s (Q2_0, in the expert kernels)."""
    return 1 if QType(qt) in INT_TYPES else 2 if QType(qt) == QType.Q2_0 else 0


def xq_bytes(qt: int, n_in: int, layouts=(1,)) -> int:
    """Shared bytes of x's limbs (quant.cuh xq_bytes) when qt's integer path is one of `layouts`, else 0."""
    if xq_layout(qt) not in layouts:
        return 0
    return (3 * n_in + n_in // 32 * 4 + n_in // 16 * 4 + 15) // 16 * 16


def launch_xq_bytes(jobs: list[Job], f32: list[bool] | None = None) -> int:
    """Shared bytes of x's limbs a launch of these jobs needs (none for the jobs marked f32)."""
    f32 = f32 or [False] * len(jobs)
    return max((xq_bytes(m.qtype, m.n_in) for j, f in zip(jobs, f32) if not f for m in (j.w, j.w2) if m is not None),
               default=0)


def _pick(j: Job, xq: int, f32: bool) -> Geom:
    """The time model's geometry of job j beside xq bytes of limbs, marked for the f32 path when `f32`."""
    rb2 = j.w2.row_bytes if j.w2 is not None else 0
    qt = j.w.qtype if j.w2 is None or OPS.get(QType(j.w.qtype), 6) >= OPS.get(QType(j.w2.qtype), 6) else j.w2.qtype
    g = geometry(qt, j.w.n_in, j.w.n_out, max(j.w.row_bytes, rb2), halves=2 if j.w2 is not None else 1,
                 tile_max=ring_tile_max(xq))
    return Geom(g.tpg, g.rr, g.nt, f32) if f32 else g


def _geoms(jobs: list[Job]) -> tuple[list[Geom], int]:
    """Each job's geometry and the launch's limb bytes: first every job as its format allows, then the jobs whose
    CTAs compute fewer rows than GEMV_INT_ROWS on the f32 path, every job re-picked beside the limbs that remain."""
    xq = launch_xq_bytes(jobs)
    geoms = [_pick(j, xq, False) for j in jobs]
    f32 = [GEMV_INT_ROWS > 0 and max(g.rows, j.w.n_out / (2 * N_SM)) < GEMV_INT_ROWS and launch_xq_bytes([j]) > 0
           for j, g in zip(jobs, geoms)]
    if any(f32):
        xq = launch_xq_bytes(jobs, f32)
        geoms = [_pick(j, xq, f) for j, f in zip(jobs, f32)]
    return geoms, xq


def ring_tile_max(xq: int) -> int:
    """The largest tile gemv_jobs' ring takes beside `xq` bytes of x limbs, 2 CTAs a multiprocessor."""
    return min(GEMV_TILE_MAX, (GEMV_SMEM_MAX - xq) // GEMV_STAGES - 64)


def gemv_plan(jobs: list[Job], name: str = "gemv", geom: Geom | None = None) -> tuple[np.ndarray, int, int, int]:
    """(job rows, tiles, shared bytes of one tile's buffer, shared bytes of x's limbs) of a launch: the table's
    contents with addresses filled. `geom` replaces the time model's pick for every job (bench/gpu_check.py's
    geometry sweep)."""
    if not 0 < len(jobs) <= GEMV_MAX_JOBS:
        raise ValueError(f"{name}: {len(jobs)} jobs in one launch (1 to {GEMV_MAX_JOBS})")
    rows = np.zeros(len(jobs), JOB_DTYPE)
    for i, j in enumerate(jobs):
        what = f"{name} job {i} ({j.w.buf.name})"
        _check_mat(j.w, what)
        need(j.x, what + " x", j.w.n_in)
        need(j.y, what + " y", j.w.n_out)
        if j.x.offset % 16:
            raise ValueError(f"{what}: x '{j.x.name}' is not 16-byte aligned")
        if not 0 <= j.mat < j.w.n_mat:
            raise ValueError(f"{what}: matrix {j.mat} of {j.w.n_mat}")
        if j.w2 is not None:
            _check_mat(j.w2, what + " (GLU partner)")
            if (j.w2.n_in, j.w2.n_out) != (j.w.n_in, j.w.n_out):
                raise ValueError(f"{what}: GLU partner is {j.w2.n_out}x{j.w2.n_in}, not {j.w.n_out}x{j.w.n_in}")
    if geom is None:
        geoms, xq = _geoms(jobs)
    else:
        geoms, xq = [geom] * len(jobs), launch_xq_bytes(jobs, [geom.f32] * len(jobs))
    cta, smem = 0, 0
    for i, (j, g) in enumerate(zip(jobs, geoms)):
        r = rows[i]
        r["w"], r["x"], r["y"] = j.w.ptr + j.mat * j.w.mat_bytes, j.x.ptr, j.y.ptr
        r["type"], r["n_in"], r["n_out"], r["row_bytes"] = j.w.qtype, j.w.n_in, j.w.n_out, j.w.row_bytes
        rb2 = 0
        if j.w2 is not None:
            r["w2"], r["type2"], r["row_bytes2"] = j.w2.ptr + j.mat * j.w2.mat_bytes, j.w2.qtype, j.w2.row_bytes
            rb2 = j.w2.row_bytes
        r["cta0"], r["geom"] = cta, g.word
        nrows = min(g.rows, j.w.n_out)
        smem = max(smem, tile_smem(nrows * j.w.row_bytes, nrows * rb2))
        cta += -(-j.w.n_out // g.rows)
    return rows, cta, smem, xq


def tile_smem(*range_bytes: int) -> int:
    """Shared bytes for staged ranges (quant.cuh stage: each from a 16-byte boundary, 16 bytes apart, + slack)."""
    total = 0
    for n in range_bytes:
        if n > 0:
            total += (n + 15 + 15) // 16 * 16 + 16
    return total + 16


def tile_fits(g: Geom, n_out: int, rb: int, halves: int = 1, xq: int = 0) -> bool:
    """Whether gemv_jobs' GEMV_STAGES buffers of geometry g's tile (`halves` matrices of rows of rb bytes) and xq
    bytes of x limbs leave room for 2 CTAs a multiprocessor."""
    return GEMV_STAGES * tile_smem(*[min(g.rows, n_out) * rb] * halves) + xq <= GEMV_SMEM_MAX


def gemv_launch(fn, name: str, table: DevArray, jobs: list[Job], geom: Geom | None = None,
                ctas: int | None = None) -> Launch:
    """Fill `table` (uploaded now, synchronously: setup time) and return the launch running every job: as many
    CTAs as the GPU holds at once (or `ctas`, at most one a tile), each walking its share of the tiles."""
    rows, tiles, stage, xq = gemv_plan(jobs, name, geom)
    if table.nbytes < rows.nbytes:
        raise ValueError(f"{name}: job table '{table.name}' holds {table.nbytes // 64} jobs, {len(jobs)} given")
    table.upload(rows.view(np.uint8))
    smem = GEMV_STAGES * stage + xq
    grid = min(tiles, ctas or resident_ctas(fn, name, CTA_THREADS, smem))
    return Launch(fn, name, (grid,), (CTA_THREADS,), smem, [P(table), I(len(jobs)), I(tiles), I(stage)])


def embed_launch(fn, name: str, table: DevMat, step: DevArray, R: DevArray, norm: DevArray | None,
                 xn: DevArray, hc: int, eps: float, rows: int = 1) -> Launch:
    """R[t, s] = table row of row t's token (step words) for every stream; xn[t, s] = RMSNorm(R[t, s]) * norm[s]
    when norm is given; rows t < step[T]."""
    E = table.n_in
    _check_mat(table, name)
    need(step, name + " step", 8 + rows, np.int32)
    need(R, name + " R", rows * hc * E)
    need(xn, name + " xn", rows * hc * E)
    if norm is not None:
        need(norm, name + " norm", hc * E)
    return Launch(fn, name, (hc, rows), (256,), 0,
                  [P(table), I(table.qtype), I(table.row_bytes), I(E), P(step), P(R), P(norm), P(xn), F(eps)])


def host_copy_launch(fn, name: str, dst: DevArray, src_dptr: int, nbytes: int, dst_offset: int = 0) -> Launch:
    """nbytes (a multiple of 4) from mapped pinned host memory at device address src_dptr into dst + dst_offset
    bytes, by a kernel (gemv.cu host_copy): enqueued on the compute stream it does not wait behind the side
    stream's copies as a copy engine's copy does. Inside a graph it re-reads the host bytes on every replay."""
    if nbytes % 4 or dst_offset % 4 or nbytes <= 0:
        raise ValueError(f"{name}: {nbytes} bytes at offset {dst_offset}: whole 4-byte words, at least one")
    if dst_offset + nbytes > dst.nbytes:
        raise ValueError(f"{name}: {nbytes} bytes at offset {dst_offset} overrun '{dst.name}' ({dst.nbytes} bytes)")
    if not src_dptr:
        raise ValueError(f"{name}: the source is not mapped into the device's address space")
    n = nbytes // 4
    return Launch(fn, name, (-(-n // 256),), (256,), 0, [P(dst.ptr + dst_offset), P(int(src_dptr)), I(n)])


def gather_launch(fn, name: str, src: DevArray, dst: DevArray, idx: DevArray, n_rows: DevArray, rows: int,
                  n: int) -> Launch:
    """dst[i] = src[idx[i]] (rows of n floats) for i < n_rows (device word), rows at most."""
    need(dst, name + " dst", rows * n)
    need(idx, name + " rows", rows, np.int32)
    need(n_rows, name + " n_rows", 1, np.int32)
    return Launch(fn, name, (min(-(-n // 256), 16), min(rows, 64)), (256,), 0, [P(src), P(dst), P(idx), P(n_rows), I(n)])
