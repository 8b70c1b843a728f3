"""hc.cu's wrappers: the gated residual's grouped norm, the write fused with the next norm, the up-gate mean."""

from __future__ import annotations

import numpy as np

from strata.cuda.arena import DevArray, DevMat
from strata.cuda.launch import F, I, Launch, P, need
from strata.kernels.gemv import KERNEL_TYPES, Geom, device_row_bytes, n_parts, tile_smem

MAX_HC = 4           # up_mix: one row set per stream, 4 at most (quant.cuh)


def rms_group_launch(fn, name: str, R: DevArray, w: DevArray, xn: DevArray, hc: int, E: int, eps: float,
                     rows: int = 1) -> Launch:
    """xn[t, s] = RMSNorm(R[t, s]) * w[s] for the hc streams of E of `rows` rows."""
    need(w, f"{name} norm", hc * E)
    for a, what in ((R, "R"), (xn, "xn")):
        need(a, f"{name} {what}", rows * hc * E)
    return Launch(fn, name, (hc, rows), (1024,), 0, [P(R), P(w), P(xn), I(E), F(eps)])


# common.cuh load_own: the norm kernels' 1024 threads hold a stream's elements in registers, RMS_BATCH (4) each
OWN_MAX = 4 * 1024


def own_elements(name: str, E: int) -> None:
    if E > OWN_MAX:
        raise ValueError(f"{name}: a stream of {E} values; the norm kernels hold at most {OWN_MAX} in registers")


def write_rms_launch(fn, name: str, R: DevArray, inj_raw: DevArray, out: DevArray, w: DevArray, xn: DevArray,
                     hc: int, E: int, eps: float, rows: int = 1) -> Launch:
    """R[t, s] += 2 sigmoid(inj_raw[t, s] / hc) * out[t], then xn[t, s] = RMSNorm(R[t, s]) * w[s]."""
    own_elements(name, E)
    need(inj_raw, name + " inject", rows * hc)
    need(out, name + " out", rows * E)
    need(w, f"{name} norm", hc * E)
    for a, what in ((R, "R"), (xn, "xn")):
        need(a, f"{name} {what}", rows * hc * E)
    return Launch(fn, name, (hc, rows), (1024,), 0, [P(R), P(inj_raw), P(out), P(w), P(xn), I(E), I(hc), F(eps)])


def lo_act_launch(fn, name: str, lo_raw: DevArray, lo: DevArray, rows: int, r: int, hc: int) -> Launch:
    """lo = silu(lo_raw / hc) over rows x r values (the batched gr_read, before its up GEMM)."""
    n = rows * r
    need(lo_raw, name + " lo_raw", n)
    need(lo, name + " lo", n)
    return Launch(fn, name, (min(-(-n // 256), 1024),), (256,), 0, [P(lo_raw), P(lo), I(n), I(hc)])


def mix_launch(fn, name: str, G: DevArray, xn: DevArray, mixed: DevArray, n_rows: DevArray, rows: int, hc: int,
               E: int) -> Launch:
    """mixed[t, e] = mean_s sigmoid(G[t, s*E + e]) * xn[t, s, e] for t < n_rows (device word), rows at most."""
    need(G, name + " G", rows * hc * E)
    need(xn, name + " xn", rows * hc * E)
    need(mixed, name + " mixed", rows * E)
    need(n_rows, name + " n_rows", 1, np.int32)
    return Launch(fn, name, (min(-(-rows * E // 256), 2048),), (256,), 0,
                  [P(G), P(xn), P(mixed), P(n_rows), I(E), I(hc)])


def up_mix_geometry(qt: int, r: int, rb: int, hc: int, E: int):
    """The up_mix tile: TPG threads per e (one row a stream), NT threads a CTA. Timed on the H200 at the flash
    shape (Q8_0, r 320: 20 parts a row; `bench/gpu_check.py --phases gemv --sweep`, bench/RESULTS.md 2026-12-04),
    128 threads with 16 a row came first (4.8 us; 64 threads with 4 a row, the rule before, 5.4; 64 a row or more
    8.3-26): every thread takes one or two of a row's parts. So TPG is the largest power of two not above the
    row's parts (4 to 32), with 128 threads a CTA, or the fitting geometry nearest to that."""
    parts = n_parts(qt, r)
    tpg = 4
    while tpg * 2 <= min(parts, 32):
        tpg *= 2
    cands = list(up_mix_geoms(rb, hc, E))
    if not cands:
        raise ValueError(f"up_mix: rows of {rb} bytes for {hc} streams do not fit one CTA's shared memory")
    return min(cands, key=lambda g: (abs(g.tpg.bit_length() - tpg.bit_length()), abs(g.nt - 128)))


def up_mix_geoms(rb: int, hc: int, E: int):
    """Every up_mix tile geometry (64, 128 or 256 threads, TPG threads per e, one row a stream) whose rows fit
    40 KB of shared memory (lo takes the rest below 48 KB): what the GPU tests and bench/gpu_check.py's sweep
    run through."""
    for nt in (64, 128, 256):
        tpg = 4
        while tpg <= nt:
            g = Geom(tpg, hc, nt)
            if tile_smem(*[min(g.groups, E) * rb] * hc) <= 40 * 1024:
                yield g
            tpg *= 2


def up_mix_launch(fn, name: str, up: DevMat, lo_raw: DevArray, xn: DevArray, mixed: DevArray, hc: int,
                  E: int, geom=None) -> Launch:
    """mixed[e] = mean_s sigmoid(up[s*E + e] . silu(lo_raw / hc)) * xn[s, e]. `geom` replaces up_mix_geometry's
    pick (its RR must be hc: bench/gpu_check.py's sweep)."""
    r = up.n_in
    if up.n_out != hc * E or up.qtype not in KERNEL_TYPES or up.row_bytes != device_row_bytes(up.qtype, r):
        raise ValueError(f"{name}: up matrix '{up.buf.name}' is {up.n_out}x{r} (type {up.qtype}), needs "
                         f"{hc * E} rows in a kernel format")
    if not 1 <= hc <= MAX_HC:
        raise ValueError(f"{name}: {hc} streams; up_mix takes at most {MAX_HC}")
    need(lo_raw, name + " lo", r)
    need(xn, name + " xn", hc * E)
    need(mixed, name + " mixed", E)
    g = geom or up_mix_geometry(up.qtype, r, up.row_bytes, hc, E)
    if g.rr != hc:
        raise ValueError(f"{name}: geometry {g} has {g.rr} rows a thread, up_mix needs one a stream ({hc})")
    ne = min(g.groups, E)
    smem = tile_smem(*([ne * up.row_bytes] * hc)) + (r + 7) // 8 * 8 * 4 + 16
    return Launch(fn, name, (-(-E // g.groups),), (g.nt,), smem,
                  [P(up), I(up.qtype), I(up.row_bytes), I(r), P(lo_raw), P(xn), P(mixed), I(E), I(hc), I(g.word)])
