"""gemv.cu's wrappers: the job table of a `gemv_jobs` launch, and the embedding lookup.

The block geometry below mirrors quant.cuh's format structs (QK elements, BB bytes, NP parts per block); it sets
how many warps share a row so that every lane has at least two parts of work when the row is long.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.cuda.arena import DevArray, DevMat
from strata.cuda.launch import F, I, Launch, P, need
from strata.quant.formats import QType, row_bytes

# ggml type -> (elements per block, bytes per block, parts per block), as in quant.cuh
BLOCKS: dict[QType, tuple[int, int, int]] = {
    QType.F32: (8, 32, 1), QType.F16: (8, 16, 1), QType.BF16: (8, 16, 1),
    QType.Q4_0: (32, 18, 4), QType.Q4_1: (32, 20, 4), QType.Q5_0: (32, 22, 4), QType.Q5_1: (32, 24, 4),
    QType.Q8_0: (32, 34, 4), QType.Q2_0: (64, 18, 4), QType.IQ4_NL: (32, 18, 4),
    QType.Q2_K: (256, 84, 16), QType.Q3_K: (256, 110, 16), QType.Q4_K: (256, 144, 8), QType.Q5_K: (256, 176, 8),
    QType.Q6_K: (256, 210, 8), QType.IQ4_XS: (256, 136, 8),
}
KERNEL_TYPES = frozenset(BLOCKS)
FLOAT_TYPES = frozenset((QType.F32, QType.F16, QType.BF16))
CTA_WARPS = 8

# struct GemvJob (quant.cuh), 64 bytes
JOB_DTYPE = np.dtype([("w", "<u8"), ("w2", "<u8"), ("x", "<u8"), ("y", "<u8"), ("type", "<i4"), ("type2", "<i4"),
                      ("n_in", "<i4"), ("n_out", "<i4"), ("row_bytes", "<i4"), ("row_bytes2", "<i4"),
                      ("cta0", "<i4"), ("wpr", "<i4")])
assert JOB_DTYPE.itemsize == 64


def device_row_bytes(qt: QType, n_in: int) -> int:
    """Bytes of one row on the device: float rows are padded to 8 elements, block rows are the file's."""
    if qt in FLOAT_TYPES:
        return (n_in + 7) // 8 * 8 * (4 if qt == QType.F32 else 2)
    return row_bytes(qt, n_in)


def warps_per_row(qt: int, n_in: int) -> int:
    """1, 2, 4 or 8 warps on one row: the most that still leave each lane two parts."""
    qk, _, np_ = BLOCKS[QType(qt)]
    parts = (n_in + qk - 1) // qk * np_
    w = 1
    while w < CTA_WARPS and parts >= 2 * 32 * (2 * w):
        w *= 2
    return w


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


def gemv_launch(fn, name: str, table: DevArray, jobs: list[Job]) -> Launch:
    """Fill `table` (uploaded now, synchronously: setup time) and return the launch running every job."""
    rows = np.zeros(len(jobs), JOB_DTYPE)
    cta = 0
    for i, j in enumerate(jobs):
        what = f"{name} job {i} ({j.w.buf.name})"
        _check_mat(j.w, what)
        need(j.x, what + " x", j.w.n_in)
        need(j.y, what + " y", j.w.n_out)
        if j.x.offset % 16:
            raise ValueError(f"{what}: x '{j.x.name}' is not 16-byte aligned")
        if not 0 <= j.mat < j.w.n_mat:
            raise ValueError(f"{what}: matrix {j.mat} of {j.w.n_mat}")
        wpr = warps_per_row(j.w.qtype, j.w.n_in)
        r = rows[i]
        r["w"], r["x"], r["y"] = j.w.ptr + j.mat * j.w.mat_bytes, j.x.ptr, j.y.ptr
        r["type"], r["n_in"], r["n_out"], r["row_bytes"] = j.w.qtype, j.w.n_in, j.w.n_out, j.w.row_bytes
        if j.w2 is not None:
            _check_mat(j.w2, what + " (GLU partner)")
            if (j.w2.n_in, j.w2.n_out) != (j.w.n_in, j.w.n_out):
                raise ValueError(f"{what}: GLU partner is {j.w2.n_out}x{j.w2.n_in}, not {j.w.n_out}x{j.w.n_in}")
            r["w2"], r["type2"], r["row_bytes2"] = j.w2.ptr + j.mat * j.w2.mat_bytes, j.w2.qtype, j.w2.row_bytes
            wpr = max(wpr, warps_per_row(j.w2.qtype, j.w2.n_in))
        r["cta0"], r["wpr"] = cta, wpr
        cta += (j.w.n_out + CTA_WARPS // wpr - 1) // (CTA_WARPS // wpr)
    if table.nbytes < rows.nbytes:
        raise ValueError(f"{name}: job table '{table.name}' holds {table.nbytes // 64} jobs, {len(jobs)} given")
    table.upload(rows.view(np.uint8))
    return Launch(fn, name, (cta,), (32 * CTA_WARPS,), 0, [P(table), I(len(jobs))])


def embed_launch(fn, name: str, table: DevMat, step: DevArray, R: DevArray, norm: DevArray | None,
                 xn: DevArray, hc: int, eps: float) -> Launch:
    """R[s] = table row step[TOKEN] for every stream; xn[s] = RMSNorm(R[s]) * norm[s] when norm is given."""
    E = table.n_in
    _check_mat(table, name)
    need(step, name + " step", 8, np.int32)
    need(R, name + " R", hc * E)
    need(xn, name + " xn", hc * E)
    if norm is not None:
        need(norm, name + " norm", hc * E)
    return Launch(fn, name, (hc,), (256,), 0,
                  [P(table), I(table.qtype), I(table.row_bytes), I(E), P(step), P(R), P(norm), P(xn), F(eps)])
