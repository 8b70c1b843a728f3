"""gemm.cu's wrappers: the job table of a batched step's matrix products (Y = X W^T over the step's rows, or the
GLU pair), and the tile shape picked per bucket of rows.

A job reads X as rows of `ldx` floats (gathered through `xrow` when given: the head's logit rows, an expert's
tokens) and writes Y as rows of `ldy` floats. The row count is device data (`n_rows`, an int32 word), so a launch
captured for a bucket of up to `max_rows` rows serves every smaller step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.cuda.arena import DevArray, DevMat
from strata.cuda.launch import I, Launch, P, need
from strata.kernels.build import define
from strata.kernels.gemv import _check_mat
from strata.quant.formats import QType

THREADS = 128
# tile shapes: (kernel prefix, BN); BN = 16 when a step has few rows (decode batches), 128 for the plain launches of
# steps of at least 128 rows (prefill chunks) over matrices of at least WIDE_OUT outputs, else 64
SHAPES = (("gemm_jobs16", 16), ("gemm_jobs64", 64), ("gemm_jobs128", 128))
# GEMM_WIDE_N=0 in $STRATA_KERNEL_DEFINES keeps those launches on BN = 64 (the comparison bench/gpu_gemm.sh runs).
# A 64 x 128 tile decodes half the weights per multiply-add that a 128 x 64 one does, and its wgmma (m64n128k16)
# reads a quarter fewer shared-memory bytes per product; the GLU tiles, with two accumulator sets, stay at 64.
WIDE_N = define("GEMM_WIDE_N", 1)
# GEMM_XPREP=1: the batched step's plain GEMM launches read their step rows split once by x_split (xsplit_launch),
# and its expert GEMMs each expert tile's rows split once by moe_split (moe.py grouped_launches), instead of
# splitting them in every M tile: ~40% of a wgmma tile's instructions a chunk (bench/GPU_NOTES.md); on the H200
# attn_qkv at 4096 rows 2.87 -> 2.17 ms (bench/RESULTS.md 2026-12-05, second session). Ops of fewer than
# XPREP_MIN_OUT outputs split x themselves: with few M tiles the split launch costs more than it saves (the hc down
# projection, 320 outputs: 0.56 -> 0.82 ms at 512 rows).
# The same define builds the tiles' copy of prepared rows (gemm.cuh); wgmma tiles only (the mma.sync tile's
# layout differs: it ignores them and splits x itself).
XPREP = define("GEMM_XPREP", 1) if define("GEMM_WGMMA", 1) else 0
XPREP_MIN_OUT = 1024
XS_ROW_ALIGN = 128      # xs planes' rows: a multiple of every tile's BN and BM
# GEMM_WPREP=1 (gemm.cuh): the batched step's plain GEMM ops, in buckets of at least WPREP_MIN_ROWS rows, read their
# weights decoded and split once per launch by w_split (wsplit_launch) instead of once per N tile, the launch's
# CTAs in groups of WPREP_GROUP M tiles (gemm_jobs_body's swz). On by default: a 4096-row chunk 10% faster than the
# tiles' own decode on an H100 (bench/RESULTS.md, 2026-12-05 fourth session); GEMM_WPREP=0 builds without it, and
# both numbers are build defines so that a variant can move them.
WPREP = define("GEMM_WPREP", 1) if define("GEMM_WGMMA", 1) else 0
WPREP_MIN_ROWS = define("GEMM_WPREP_MIN_ROWS", 1024)
WPREP_GROUP = define("GEMM_WPREP_GROUP", 16)


def chunk_k(types) -> int:
    """The k-chunk (gemm.cuh BK) for matrices of these ggml types: 128 when one is Q6_K (its part groups are 128
    elements), else 64 (smaller tiles, more CTAs per multiprocessor)."""
    return 128 if any(QType(t) == QType.Q6_K for t in types) else 64


WIDE_OUT = 1024         # plain 64-row steps take 128 weight rows a CTA when every job has at least this many outputs
# GEMM_NARROW_APART=1: the batched step's input projections put their matrices of fewer than WIDE_OUT outputs in a
# launch of their own (strata/cuda/batch.py _gemms), so that the wide ones keep the wide tiles: a 4096-row chunk
# 1,097.3 -> 1,071.5 ms, 512 rows 339.7 -> 333.6 (H100, same call, bench/RESULTS.md 2026-12-07); 0 for the comparison
NARROW_APART = define("GEMM_NARROW_APART", 1)


def tile_bm(bn: int, glu: bool, n_out: int = WIDE_OUT) -> int:
    """Weight rows a CTA takes (gemm.cu / moe.cu's BM = WM * MT * 16; 64 in the tiles of 128 step rows, whose
    products share the tile's weights over twice the rows instead): 128 for plain tiles of 64 step rows (each
    warp 64 x 32: fewer shared-memory bytes per multiply-add, which bounds the tile) over matrices of at least
    WIDE_OUT outputs (n_out: the launch's smallest), else 64: a GLU tile's two accumulator sets, 16 step rows, or
    few outputs, where 64-row tiles keep twice the CTAs busy (H200, 4096 rows: hc down 320 x 10240 0.81 ms in
    64-row tiles, 1.14 in 128; attn_qkv 10240 x 2560 3.61 against 3.09; but expert gate 640 x 2560 0.33 against
    0.26, so the rule should weigh the input length too: bench/GPU_NOTES.md)."""
    return 128 if bn == 64 and not glu and n_out >= WIDE_OUT else 64


def kernel_name(max_rows: int, bk: int, glu: bool, n_out: int) -> str:
    """gemm.cu's kernel for a launch: the tile's step rows (shape_for), k-chunk, GLU, and 128 or 64 weight rows."""
    kernel, bn = shape_for(max_rows, glu, n_out)
    narrow = "_m64" if bn == 64 and not glu and tile_bm(bn, glu, n_out) == 64 else ""
    return f"{kernel}_k{bk}{'_glu' if glu else ''}{narrow}"


def smem_bytes(bk: int, bn: int, bm: int, glu: bool, compact: bool = False) -> int:
    """gemm_tile's shared memory: the weight tile (two for GLU) and the rows' tile, BK + 4 floats a row, then the
    rows' power-of-two shifts (two weight tiles' and the rows', int32); compact (compact_tile): the weight tiles'
    hi halves only, BK halves a row. One k-chunk of the tile at a time: two (the next chunk decoded while the tensor
    cores read this one, 2 CTAs a multiprocessor) made a 4096-row chunk 15% slower on an H100 than 3 CTAs of one
    (bench/RESULTS.md, 2026-12-05 fifth session), and copying the next chunk's weight bytes into shared memory while
    this one decodes 5% slower (sixth session)."""
    w_row = 2 * bk if compact else (bk + 4) * 4
    return (2 if glu else 1) * bm * w_row + bn * (bk + 4) * 4 + (2 * bm + bn) * 4


# gemm.cuh f16_exact and GEMM_COMPACT_W: the formats whose tiles write no lo halves, and whether a wgmma tile of them
# then packs its shared memory (sm_90: the wgmma tile; elsewhere the mma.sync tile's rows interleave the halves)
EXACT_TYPES = frozenset({QType.Q2_0, QType.F16, QType.BF16}) if define("GEMM_EXACT_W", 1) else frozenset()
COMPACT_W = define("GEMM_COMPACT_W", 1) if define("GEMM_WGMMA", 1) else 0


def compact_tile(arch: int, types) -> bool:
    """Whether tiles of weights of these ggml types (every job's, GLU partners' too) take smem_bytes' compact size on a
    device of this arch (0: unknown, the full size: always enough)."""
    return bool(COMPACT_W) and arch == 90 and all(QType(t) in EXACT_TYPES for t in types)

# struct GemmJob (gemm.cu), 120 bytes
GEMM_JOB_DTYPE = np.dtype([("w", "<u8"), ("w2", "<u8"), ("x", "<u8"), ("y", "<u8"), ("xrow", "<u8"),
                           ("type", "<i4"), ("type2", "<i4"), ("n_in", "<i4"), ("n_out", "<i4"),
                           ("row_bytes", "<i4"), ("row_bytes2", "<i4"), ("ldx", "<i4"), ("ldy", "<i4"),
                           ("pad0", "<i4"), ("pad1", "<i4"), ("xs", "<u8"), ("xs_rows", "<i4"), ("pad2", "<i4"),
                           ("ws", "<u8"), ("ws2", "<u8"), ("ws_rows", "<i4"), ("pad3", "<i4")])
assert GEMM_JOB_DTYPE.itemsize == 120


@dataclass
class GemmJob:
    """Y[n] = w @ X[n] (or silu(w @ X[n]) * (w2 @ X[n])) for the step's rows n; X (rows, ldx), Y (rows, ldy).
    ldx / ldy default to n_in / n_out; xrow (int32) gathers X's rows."""
    w: DevMat
    x: DevArray
    y: DevArray
    w2: DevMat | None = None
    mat: int = 0
    xrow: DevArray | None = None
    ldx: int | None = None
    ldy: int | None = None
    xs: "XSplit | None" = None        # x split once for the launch (xsplit_launch), in the launch's k-chunk
    ws: "XSplit | None" = None        # w (and w2: ws2) split once for the launch (wsplit_launch)
    ws2: "XSplit | None" = None


@dataclass
class XSplit:
    """A buffer of x_split's planes: x (rows, ldx) over n_in inputs, split in k-chunks of bk for buckets of up to
    max_rows rows."""
    buf: DevArray
    n_in: int
    bk: int
    max_rows: int

    @property
    def rows(self) -> int:
        return xsplit_rows(self.max_rows)


def xsplit_rows(max_rows: int) -> int:
    """Rows of x_split's planes for steps of up to max_rows rows."""
    return -(-max_rows // XS_ROW_ALIGN) * XS_ROW_ALIGN


def xsplit_bytes(n_in: int, bk: int, max_rows: int) -> int:
    """x_split's output: per k-chunk, the hi and lo planes (2 bk bytes a row each) and the rows' int32 shifts."""
    return -(-n_in // bk) * xsplit_rows(max_rows) * (4 * bk + 4)


def xsplit_launch(fn_of, name: str, x: DevArray, ldx: int, xs: XSplit, n_rows: DevArray, rows: int) -> Launch:
    """x_split of a bucket of up to `rows` rows (the live count: n_rows, device data) into xs."""
    if not 0 < rows <= xs.max_rows:
        raise ValueError(f"{name}: {rows} rows for a split of at most {xs.max_rows}")
    need(x, name + " x", (rows - 1) * ldx + xs.n_in)
    need(xs.buf, name + " split", xsplit_bytes(xs.n_in, xs.bk, xs.max_rows), np.uint8)
    need(n_rows, name + " n_rows", 1, np.int32)
    return Launch(fn_of(f"x_split_k{xs.bk}"), name, (-(-rows // 64), -(-xs.n_in // xs.bk)), (THREADS,), 0,
                  [P(x), I(ldx), I(xs.n_in), P(n_rows), P(xs.buf), I(xs.rows)])


def wsplit_launch(fn_of, name: str, w: DevMat, mat: int, ws: XSplit) -> Launch:
    """w_split of matrix `mat` of w into ws (planes of ws.rows >= w.n_out rows, in ws.bk chunks)."""
    _check_mat(w, name)
    if (ws.n_in, ws.max_rows) != (w.n_in, w.n_out) or not 0 <= mat < w.n_mat:
        raise ValueError(f"{name}: a split of {ws.max_rows} x {ws.n_in} for matrix {mat} of {w.n_mat} "
                         f"{w.n_out} x {w.n_in}")
    need(ws.buf, name + " split", xsplit_bytes(ws.n_in, ws.bk, ws.max_rows), np.uint8)
    return Launch(fn_of(f"w_split_k{ws.bk}"), name, (ws.rows // 64, -(-ws.n_in // ws.bk)), (THREADS,), 0,
                  [P(w.ptr + mat * w.mat_bytes), I(w.qtype), I(w.row_bytes), I(w.n_out), I(w.n_in), P(ws.buf),
                   I(ws.rows)])


def shape_for(max_rows: int, glu: bool = False, n_out: int = WIDE_OUT) -> tuple[str, int]:
    """(kernel name, BN) for a bucket of up to max_rows rows, in a launch with (glu) or without GLU jobs whose
    smallest matrix has n_out outputs (narrow matrices keep BN = 64: twice the CTAs of a 128-row tile)."""
    if max_rows <= 16:
        return SHAPES[0]
    return SHAPES[2] if WIDE_N and not glu and max_rows >= 128 and n_out >= WIDE_OUT else SHAPES[1]


def job_table(name: str, n_jobs: int, reserve) -> DevArray:
    return reserve(name, (n_jobs * GEMM_JOB_DTYPE.itemsize,), np.uint8)


def gemm_plan(jobs: list[GemmJob], max_rows: int, name: str = "gemm", arch: int = 0) -> tuple[np.ndarray, int, int,
                                                                                          str]:
    """(job rows, M tiles, dynamic shared bytes, kernel name) of a launch over up to max_rows rows on a device of
    this arch (compact_tile)."""
    rows = np.zeros(len(jobs), GEMM_JOB_DTYPE)
    tiles, glu = 0, any(j.w2 is not None for j in jobs)
    bk = chunk_k([j.w.qtype for j in jobs] + [j.w2.qtype for j in jobs if j.w2 is not None])
    n_out = min(j.w.n_out for j in jobs)
    _, bn = shape_for(max_rows, glu, n_out)
    bm = tile_bm(bn, glu, n_out)
    for i, j in enumerate(jobs):
        what = f"{name} job {i} ({j.w.buf.name})"
        _check_mat(j.w, what)
        ldx, ldy = j.ldx or j.w.n_in, j.ldy or j.w.n_out
        if ldx < j.w.n_in or ldy < j.w.n_out:
            raise ValueError(f"{what}: row strides {ldx}/{ldy} under the matrix's {j.w.n_in}/{j.w.n_out}")
        n_x = max_rows if j.xrow is None else None
        if n_x is not None:
            need(j.x, what + " x", (n_x - 1) * ldx + j.w.n_in)
        need(j.y, what + " y", (max_rows - 1) * ldy + j.w.n_out)
        if j.xrow is not None:
            need(j.xrow, what + " xrow", max_rows, np.int32)
        if not 0 <= j.mat < j.w.n_mat:
            raise ValueError(f"{what}: matrix {j.mat} of {j.w.n_mat}")
        r = rows[i]
        r["w"], r["x"], r["y"] = j.w.ptr + j.mat * j.w.mat_bytes, j.x.ptr, j.y.ptr
        r["xrow"] = 0 if j.xrow is None else j.xrow.ptr
        r["type"], r["n_in"], r["n_out"], r["row_bytes"] = j.w.qtype, j.w.n_in, j.w.n_out, j.w.row_bytes
        r["ldx"], r["ldy"] = ldx, ldy
        if j.xs is not None:
            if j.xrow is not None or j.w2 is not None or (j.xs.n_in, j.xs.bk) != (j.w.n_in, bk) or \
                    j.xs.max_rows < max_rows:
                raise ValueError(f"{what}: x split for {j.xs.n_in} inputs in chunks of {j.xs.bk} up to "
                                 f"{j.xs.max_rows} rows; the job needs {j.w.n_in} in {bk} up to {max_rows}, no "
                                 f"gather, no GLU")
            r["xs"], r["xs_rows"] = j.xs.buf.ptr, j.xs.rows
        if j.ws is not None:
            splits = [(j.ws, j.w)] + ([(j.ws2, j.w2)] if j.w2 is not None else [])
            if any(ws is None or (ws.n_in, ws.bk, ws.max_rows) != (w.n_in, bk, w.n_out) for ws, w in splits) or \
                    (j.ws2 is not None and j.ws2.rows != j.ws.rows):
                raise ValueError(f"{what}: weights split as {j.ws.max_rows} x {j.ws.n_in} in chunks of {j.ws.bk}; "
                                 f"the job needs {j.w.n_out} x {j.w.n_in} in {bk}, and its GLU partner's too")
            r["ws"], r["ws_rows"] = j.ws.buf.ptr, j.ws.rows
            r["ws2"] = 0 if j.ws2 is None else j.ws2.buf.ptr
        elif j.ws2 is not None:
            raise ValueError(f"{what}: a split of the GLU partner without one of the matrix")
        if j.w2 is not None:
            _check_mat(j.w2, what + " (GLU partner)")
            if (j.w2.n_in, j.w2.n_out) != (j.w.n_in, j.w.n_out):
                raise ValueError(f"{what}: GLU partner is {j.w2.n_out}x{j.w2.n_in}, not {j.w.n_out}x{j.w.n_in}")
            r["w2"], r["type2"], r["row_bytes2"] = j.w2.ptr + j.mat * j.w2.mat_bytes, j.w2.qtype, j.w2.row_bytes
        tiles += -(-j.w.n_out // bm)
    compact = compact_tile(arch, [j.w.qtype for j in jobs] + [j.w2.qtype for j in jobs if j.w2 is not None])
    return rows, tiles, smem_bytes(bk, bn, bm, glu, compact), kernel_name(max_rows, bk, glu, n_out)


def gemm_launch(fn_of, name: str, table: DevArray, jobs: list[GemmJob], n_rows: DevArray, max_rows: int,
                swz: int = 0, ks: int = 1, part: DevArray | None = None, arch: int = 0) -> Launch:
    """Fill `table` (uploaded now: setup time) and return the launch; fn_of(kernel name) -> the function. swz: the
    CTAs' order (gemm.cu gemm_jobs_body: groups of swz M tiles over every N tile; 0: M tiles fastest). ks > 1: a
    split-K launch whose ks slices write `part` (k_slices; ksum_launch adds them into the jobs' y). arch: the
    device's (compact_tile)."""
    need(n_rows, name + " n_rows", 1, np.int32)
    rows, tiles, smem, kernel = gemm_plan(jobs, max_rows, name, arch)
    if table.nbytes < rows.nbytes:
        raise ValueError(f"{name}: job table '{table.name}' holds {table.nbytes // GEMM_JOB_DTYPE.itemsize} jobs, "
                         f"{len(jobs)} given")
    table.upload(rows.view(np.uint8))
    _, bn = shape_for(max_rows, any(j.w2 is not None for j in jobs), min(j.w.n_out for j in jobs))
    part_ld = sum(j.w.n_out for j in jobs)
    if ks > 1:
        if part is None or any(j.w2 is not None for j in jobs):
            raise ValueError(f"{name}: a split-K launch needs plain jobs and a partials buffer")
        need(part, name + " partials", ks * max_rows * part_ld)
    return Launch(fn_of(kernel), name, (tiles, -(-max_rows // bn), ks), (THREADS,), smem,
                  [P(table), I(len(jobs)), P(n_rows), I(swz), P(part if ks > 1 else None), I(ks), I(part_ld),
                   I(max_rows)])


# split-K (gemm.cu gemm_jobs_body): a plain launch whose M x N tiles fill less than a wave of KSPLIT_CTAS CTAs a
# multiprocessor (the tiles hold 3-4) runs its k-chunks in that many slices, at least KSPLIT_MIN_CHUNKS chunks each,
# and gemm_ksum adds the slices in order: the hc reads' down projections (324 outputs over 10240 inputs, 160
# k-chunks) took 0.70 ms a launch at 512 rows, 48 CTAs of 160 chunks, against 0.45 at 4096 rows (H100,
# bench/RESULTS.md 2026-12-07). GEMM_KSPLIT=0 builds without it (the comparison).
KSPLIT = define("GEMM_KSPLIT", 1)
KSPLIT_CTAS = 3
KSPLIT_MIN_CHUNKS = 8


def k_slices(jobs: list[GemmJob], max_rows: int, n_sm: int) -> int:
    """The k slices of a launch of these jobs over a bucket of max_rows rows (1: no split)."""
    if not KSPLIT or any(j.w2 is not None for j in jobs):
        return 1
    n_out = min(j.w.n_out for j in jobs)
    _, bn = shape_for(max_rows, False, n_out)
    bm = tile_bm(bn, False, n_out)
    bk = chunk_k([j.w.qtype for j in jobs])
    ctas = sum(-(-j.w.n_out // bm) for j in jobs) * -(-max_rows // bn)
    chunks = min(-(-j.w.n_in // bk) for j in jobs)
    return max(1, min(KSPLIT_CTAS * n_sm // ctas, chunks // KSPLIT_MIN_CHUNKS))


def ksum_launch(fn, name: str, table: DevArray, jobs: list[GemmJob], n_rows: DevArray, max_rows: int, ks: int,
                part: DevArray) -> Launch:
    """gemm_ksum: a split-K launch's ks slices (gemm_launch with the same table, jobs and part) into the jobs' y."""
    part_ld = sum(j.w.n_out for j in jobs)
    need(part, name + " partials", ks * max_rows * part_ld)
    return Launch(fn, name, (-(-part_ld // 256), max_rows), (256,), 0,
                  [P(table), I(len(jobs)), P(n_rows), P(part), I(ks), I(part_ld), I(max_rows)])
