"""Every CUDA kernel against the numpy reference (strata.reference.*, strata.quant.dequant) on fresh random inputs.

The contract is the f32 path: ||out - ref|| / ||ref|| <= 1e-5, the reference in float64 for GEMVs (dequantized
weights @ x) and strata.reference's float32 functions for the rest. Outputs are poisoned with NaN before each
run, so an unwritten element fails. Sizes are not multiples of the block or warp sizes where the op allows.
The GPU runs are skipped, with the reason, where there is no GPU or no cuda-bindings. The tests marked
`both_rigs` (and the emulator's share of the GEMM cases) run a second time on the CPU: the same kernel sources
compiled by g++ under tests/kernel_emu.h, so CI checks what every kernel file computes, indexes and synchronizes
(not its speed) on a machine without a GPU.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from strata.config import ModelConfig
from strata.cuda import driver as drv
from strata.cuda.weights import device_rows
from strata.kernels import Kernels
from strata.kernels import gdn as kgdn
from strata.kernels import gemv as kgemv
from strata.kernels import hc as khc
from strata.kernels import moe as kmoe
from strata.kernels import ple as kple
from strata.kernels import qsa as kqsa
from strata.kernels.gemv import Job
from strata.quant.dequant import dequantize
from strata.quant.formats import QType, row_bytes, type_size
from strata.reference.common import rms_norm, rope, rope_inv_freq
from strata.reference.gdn import GdnState, delta_rule, gdn_chunk
from strata.reference.hc import gr_read, gr_write
from strata.reference.moe import combine, expert_ffn, route
from strata.reference.ple import PleState, ple_block
from strata.reference.qsa import QsaState, block_scores, qsa_chunk, select_blocks

from kernel_emu import ArenaRig, EmuKernels, EmuRig, why_not

_WHY = drv.available()

TOL = 1e-5
F32 = np.float32
STEP_N = 16          # step words the tests reserve: the 8 STEP_* words, then the rows' tokens


def test_sources_take_no_generic_lambda():
    """The H200 machine's NVRTC 13.0 takes a generic lambda in device code for a host function and refuses the
    source (13.5, this machine's, accepts it): no kernel source may hold one, which no local build would catch."""
    import re
    from strata.kernels.build import HEADERS, HERE, SOURCES
    for f in [f"{n}.cu" for n in SOURCES] + list(HEADERS):
        text = (HERE / f).read_text()
        for m in re.finditer(r"\[[^\]\n]*\]\s*\(([^)]*)\)", text):
            assert not re.search(r"\bauto\b", m.group(1)), \
                f"{f} line {text.count(chr(10), 0, m.start()) + 1}: a generic lambda ({m.group(0)})"


def step_words(pos: int = 0, ring: int = 0, tokens=(0,), rows: int | None = None, flags: int = 1) -> np.ndarray:
    """The step block (common.cuh): token, position, ring, row count T, logit rows, flags (1: the doorbell carries
    x), ..., then the rows' tokens; `rows` gives T where the kernels read no tokens (more rows than the block
    holds)."""
    w = np.zeros(STEP_N, np.int32)
    w[0], w[1], w[2], w[3], w[4], w[5] = tokens[0], pos, ring, len(tokens) if rows is None else rows, 1, flags
    w[8:8 + len(tokens)] = tokens
    return w


class Rows:
    """A float matrix with the reference's `W @ X` meaning (strata.model.weights.Mat's): W applied to every row of
    X (T, n_in), or to a vector."""

    def __init__(self, w: np.ndarray):
        self.w = w

    def __matmul__(self, x: np.ndarray) -> np.ndarray:
        return x @ self.w.T if x.ndim == 2 else self.w @ x


def as_rows(w: SimpleNamespace, *names: str) -> SimpleNamespace:
    """w with the named matrices wrapped in Rows (the reference's layer weights, one token a step)."""
    return SimpleNamespace(**{k: Rows(v) if k in names else v for k, v in vars(w).items()})

# where each block format keeps its fp16 scales: (offset of d, offset of dmin/m or None)
SCALES = {QType.Q4_0: (0, None), QType.Q4_1: (0, 2), QType.Q5_0: (0, None), QType.Q5_1: (0, 2),
          QType.Q8_0: (0, None), QType.Q2_0: (0, None), QType.IQ4_NL: (0, None), QType.Q2_K: (80, 82),
          QType.Q3_K: (108, None), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208, None),
          QType.IQ4_XS: (0, None)}


def rel(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def random_matrix(qt: QType, n_out: int, n_in: int, rng, scale: float = 1.0) -> np.ndarray:
    """Valid random blocks of qt: uint8 (n_out, row_bytes); fp16 scales finite, about `scale` x U(0.2, 1).
    scale ~ 1 / (64 sqrt(n_in)) keeps W @ x O(1) for unit x, so the gates that follow do not saturate."""
    if qt in (QType.F32, QType.F16, QType.BF16):
        v = (rng.standard_normal((n_out, n_in)) * scale).astype(F32)
        if qt == QType.F32:
            return v.view(np.uint8)
        if qt == QType.F16:
            return v.astype(np.float16).view(np.uint8)
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    rb, ts = row_bytes(qt, n_in), type_size(qt)
    raw = rng.integers(0, 256, (n_out, rb), dtype=np.uint8)
    blocks = raw.reshape(-1, ts)
    d_off, m_off = SCALES[qt]
    for off in (d_off, m_off):
        if off is not None:
            h = (scale * rng.uniform(0.2, 1.0, blocks.shape[0]) * rng.choice([-1, 1], blocks.shape[0])).astype(np.float16)
            blocks[:, off:off + 2] = h.view(np.uint8).reshape(-1, 2)
    return raw


class Rig(ArenaRig):
    """One arena per test: reserve, commit, fill, launch eagerly, read back."""

    def __init__(self, dev, kern):
        super().__init__(kern)
        self.dev = dev
        self.stream = drv.Stream()

    def commit(self):
        self.A.commit()
        self.A.zero(self.stream)
        for a, v in self.fills:
            a.upload(v)

    def run(self, *launches):
        for launch in launches:
            launch.enqueue(self.stream)
        self.stream.synchronize("test")

    def close(self):
        self.A.free()
        self.stream.destroy()


@pytest.fixture(scope="module")
def gpu():
    if _WHY is not None:
        pytest.skip(f"CUDA kernels need a GPU: {_WHY}")
    dev = drv.Device.open()
    return dev, Kernels(dev.arch)


@pytest.fixture(scope="module")
def emu_kernels(request, tmp_path_factory):
    if why_not() is not None:
        pytest.skip(f"the kernels' CPU emulator: {why_not()}")
    cache = getattr(request.config, "cache", None)        # pytest's cache dir keeps the builds between runs
    return EmuKernels(cache.mkdir("kernel_emu") if cache else tmp_path_factory.mktemp("kernel_emu"))


@pytest.fixture(params=[pytest.param("gpu", marks=pytest.mark.gpu)])
def rig(request, monkeypatch):
    """The GPU's rig, or (tests marked both_rigs) the CPU emulator's, which gives the wrappers 3 resident CTAs."""
    r = EmuRig(request.getfixturevalue("emu_kernels"), monkeypatch) if request.param == "emu" else \
        Rig(*request.getfixturevalue("gpu"))
    yield r
    r.close()


GPU_RIG = pytest.param("gpu", marks=pytest.mark.gpu)
both_rigs = pytest.mark.parametrize("rig", [GPU_RIG, "emu"], indirect=True)


def cfg_tiny(**kw) -> ModelConfig:
    base = dict(n_layer=4, n_embd=100, n_vocab=77, n_ctx_train=4096, rms_eps=1e-6, n_head=4, n_head_kv=2,
                head_dim=32, n_rot=8, rope_base=1e7, idx_heads=4, idx_dim=16, idx_budget=8,
                compress_ratios=(0, 0, 0, 4), ssm_conv=4, ssm_state=16, ssm_k_heads=2, ssm_v_heads=6,
                recurrent=(True, True, True, False), hc=4, hc_rank=12, n_expert=13, n_expert_used=3, n_ff_exp=20,
                n_ff_shexp=24)
    base.update(kw)
    return ModelConfig(**base)


# ---- GEMV: every kernel format, odd row counts, short and split rows, several jobs per launch -------------

GEMV_CASES = [(qt, n) for qt in sorted(kgemv.KERNEL_TYPES) for n in (1, 3)]


@both_rigs
@pytest.mark.parametrize("qt,blocks", GEMV_CASES, ids=[f"{QType(q).name}-{b}" for q, b in GEMV_CASES])
def test_gemv_formats(rig, qt, blocks, monkeypatch):
    monkeypatch.setattr(kgemv, "GEMV_INT_ROWS", 0)        # the integer path wherever the format has one
    rng = np.random.default_rng(int(qt) * 7 + blocks)
    qk = kgemv.BLOCKS[qt][0]
    n_in = 8 * blocks * 12 + 3 if qt in kgemv.FLOAT_TYPES else qk * blocks      # floats: not a multiple of 8
    n_long = 4099 if qt in kgemv.FLOAT_TYPES else qk * max(2, 4096 // qk)      # many parts: 2-8 warps per row
    jobs_in = [(37, n_in), (5, n_long)]
    mats, xs, ys, refs = [], [], [], []
    for i, (n_out, n) in enumerate(jobs_in):
        raw = random_matrix(qt, n_out, n, rng)
        x = rng.standard_normal(n).astype(F32)
        mats.append(rig.mat(f"w{i}", raw, qt, n_out, n))
        xs.append(rig.buf(f"x{i}", (n,), value=x))
        ys.append(rig.buf(f"y{i}", (n_out,)))
        W = dequantize(raw, qt).reshape(n_out, n).astype(np.float64)
        refs.append(W @ x.astype(np.float64))
    table = kgemv.job_table("jobs", 2, rig.A.reserve)
    rig.commit()
    launch = kgemv.gemv_launch(rig.k.fn("gemv", "gemv_jobs"), "gemv", table,
                               [Job(m, x, y) for m, x, y in zip(mats, xs, ys)])
    for _ in range(2):                                   # twice: the same launch, re-run, is the same function
        rig.poison(*ys)
        rig.run(launch)
        for y, ref in zip(ys, refs):
            assert rel(y.download(), ref) <= TOL, f"{QType(qt).name}: {y.name} rel err {rel(y.download(), ref):.2e}"
    assert kgemv.warps_per_row(qt, n_long) > 1


GEOMS = [kgemv.Geom(tpg, rr, kgemv.CTA_THREADS) for tpg in (4, 8, 16, 32, 64, 128, 256) for rr in (1, 2, 3, 4)] + \
        [kgemv.Geom(tpg, rr, kgemv.CTA_THREADS, f32=True) for tpg, rr in ((8, 4), (64, 3), (128, 1))]


@both_rigs
@pytest.mark.parametrize("qt", sorted(kgemv.KERNEL_TYPES), ids=lambda q: QType(q).name)
def test_gemv_every_geometry(rig, qt):
    """Every tile geometry computes the same product: the time model's pick (fitted to timings) is then a question
    of speed only. A GLU pair too, since a pair's tile holds both matrices."""
    rng = np.random.default_rng(int(qt) + 101)
    qk = kgemv.BLOCKS[qt][0]
    n_in = 8 * 40 + 5 if qt in kgemv.FLOAT_TYPES else qk * max(3, 768 // qk)
    n_out = 45                                            # not a multiple of any tile's rows
    raw, raw2 = random_matrix(qt, n_out, n_in, rng), random_matrix(qt, n_out, n_in, rng)
    x = rng.standard_normal(n_in).astype(F32)
    w, w2 = rig.mat("w", raw, qt, n_out, n_in), rig.mat("w2", raw2, qt, n_out, n_in)
    xb, y = rig.buf("x", (n_in,), value=x), rig.buf("y", (n_out,))
    table = kgemv.job_table("jobs", 1, rig.A.reserve)
    rig.commit()
    W, W2 = (dequantize(r, qt).reshape(n_out, n_in).astype(np.float64) for r in (raw, raw2))
    a, b = W @ x.astype(np.float64), W2 @ x.astype(np.float64)
    with np.errstate(over="ignore"):
        glu = a / (1 + np.exp(-a)) * b
    for g in GEOMS:
        for pair, ref in ((None, a), (w2, glu)):
            if not kgemv.tile_fits(g, n_out, w.row_bytes, 1 if pair is None else 2, kgemv.xq_bytes(qt, n_in)):
                continue
            rig.poison(y)
            rig.run(kgemv.gemv_launch(rig.k.fn("gemv", "gemv_jobs"), "gemv", table, [Job(w, xb, y, w2=pair)], g))
            err = rel(y.download(), ref)
            assert err <= TOL, (f"{QType(qt).name} tpg {g.tpg} rr {g.rr}{' f32' if g.f32 else ''}"
                                f"{' GLU' if pair else ''}: rel err {err:.2e}")


@both_rigs
def test_gemv_int_rows(rig, monkeypatch):
    """Jobs whose CTAs compute fewer rows than GEMV_INT_ROWS take the f32 path (the geometry word's bit 7, no limbs
    made for them), the others in the same launch the integer path; both give the product."""
    rng = np.random.default_rng(5)
    shapes = [(QType.Q8_0, 3, 2048), (QType.Q4_K, 2400, 256)]  # 3 rows; 2400 rows: ~9 a CTA of the GPU's 264
    ys, refs, jobs = [], [], []
    for i, (qt, n_out, n_in) in enumerate(shapes):
        raw = random_matrix(qt, n_out, n_in, rng)
        x = rng.standard_normal(n_in).astype(F32)
        m, xb, y = rig.mat(f"w{i}", raw, qt, n_out, n_in), rig.buf(f"x{i}", (n_in,), value=x), rig.buf(f"y{i}", (n_out,))
        ys.append(y)
        refs.append(dequantize(raw, qt).reshape(n_out, n_in).astype(np.float64) @ x.astype(np.float64))
        jobs.append(Job(m, xb, y))
    table = kgemv.job_table("jobs", 2, rig.A.reserve)
    rig.commit()
    monkeypatch.setattr(kgemv, "GEMV_INT_ROWS", 8)
    rows, _, _, xq = kgemv.gemv_plan(jobs)
    assert [bool(w >> 7 & 1) for w in rows["geom"]] == [True, False]
    assert xq == kgemv.xq_bytes(QType.Q4_K, 256)               # limbs for the integer job's x only
    rig.poison(*ys)
    rig.run(kgemv.gemv_launch(rig.k.fn("gemv", "gemv_jobs"), "gemv", table, jobs))
    for y, ref in zip(ys, refs):
        assert rel(y.download(), ref) <= TOL, f"{y.name}: rel err {rel(y.download(), ref):.2e}"


@both_rigs
@pytest.mark.parametrize("qt", sorted(kgemv.INT_TYPES | {QType.BF16}), ids=lambda q: QType(q).name)
def test_gemv_x_range(rig, qt, monkeypatch):
    """x whose groups of 32 span 12 decades, one of them zero, one with an outlier: the integer path scales each
    group on its own (quant.cuh xq_prep) and stays within the f32 contract; an inf or a NaN anywhere in x makes
    every output non-finite, as the f32 path's products do."""
    monkeypatch.setattr(kgemv, "GEMV_INT_ROWS", 0)        # the integer path, whose limbs are the subject
    rng = np.random.default_rng(int(qt) + 7)
    n_in, n_out = 512, 21
    raw = random_matrix(qt, n_out, n_in, rng)
    x = (rng.standard_normal(n_in) * np.repeat(10.0 ** rng.uniform(-6, 6, n_in // 32), 32)).astype(F32)
    x[64:96] = 0
    x[200] = np.float32(3e7)
    w, xb, y = rig.mat("w", raw, qt, n_out, n_in), rig.buf("x", (n_in,)), rig.buf("y", (n_out,))
    table = kgemv.job_table("jobs", 1, rig.A.reserve)
    rig.commit()
    launch = kgemv.gemv_launch(rig.k.fn("gemv", "gemv_jobs"), "gemv", table, [Job(w, xb, y)])
    W = dequantize(raw, qt).reshape(n_out, n_in).astype(np.float64)
    xb.upload(x)
    rig.poison(y)
    rig.run(launch)
    assert rel(y.download(), W @ x.astype(np.float64)) <= TOL
    for bad in (np.inf, np.nan):
        xb.upload(np.where(np.arange(n_in) == 333, np.float32(bad), x))
        rig.poison(y)
        rig.run(launch)
        assert not np.isfinite(y.download()).any(), f"x[333] = {bad}: a finite output"


@both_rigs
def test_gemv_mixed_jobs_and_glu(rig, monkeypatch):
    """One launch, four jobs of four types, one of them a GLU pair: y = silu(G x) * (U x); on the full grid and on
    grids of fewer CTAs than tiles."""
    monkeypatch.setattr(kgemv, "GEMV_INT_ROWS", 0)        # integer and f32 jobs in one launch, limbs made once
    rng = np.random.default_rng(5)
    n = 512
    x = rng.standard_normal(n).astype(F32)
    specs = [(QType.Q4_K, 33), (QType.BF16, 9), (QType.IQ4_XS, 70), (QType.Q8_0, 1)]
    jobs, ys, refs = [], [], []
    xb = rig.buf("x", (n,), value=x)
    for i, (qt, n_out) in enumerate(specs):
        raw = random_matrix(qt, n_out, n, rng)
        m = rig.mat(f"w{i}", raw, qt, n_out, n)
        y = rig.buf(f"y{i}", (n_out,))
        ref = dequantize(raw, qt).reshape(n_out, n).astype(np.float64) @ x
        w2 = None
        if i == 0:
            raw2 = random_matrix(QType.Q6_K, n_out, n, rng)
            w2 = rig.mat("w0b", raw2, QType.Q6_K, n_out, n)
            up = dequantize(raw2, QType.Q6_K).reshape(n_out, n).astype(np.float64) @ x
            with np.errstate(over="ignore"):                  # silu of a large negative logit is -0
                ref = ref / (1 + np.exp(-ref)) * up
        jobs.append(Job(m, xb, y, w2=w2))
        ys.append(y)
        refs.append(ref)
    table = kgemv.job_table("jobs", len(jobs), rig.A.reserve)
    rig.commit()
    first = None
    # the GPU's full grid (one tile a CTA here), then fewer CTAs than tiles: each walks several tiles of several
    # jobs through its shared buffers, and every row comes out the same, bit for bit
    for ctas in (None, 1, 2, 5):
        launch = kgemv.gemv_launch(rig.k.fn("gemv", "gemv_jobs"), "gemv", table, jobs, ctas=ctas)
        rig.poison(*ys)
        rig.run(launch)
        for y, ref, (qt, _) in zip(ys, refs, specs):
            assert rel(y.download(), ref) <= TOL, f"{qt.name}, {ctas} CTAs: {rel(y.download(), ref):.2e}"
        got = [y.download() for y in ys]
        first = first or got
        assert all(np.array_equal(a, b) for a, b in zip(got, first)), f"{ctas} CTAs: not the full grid's result"
    # the kernel keeps its job table in shared memory: a launch of more jobs than it holds is refused
    with pytest.raises(ValueError, match="jobs in one launch"):
        kgemv.gemv_plan(jobs * 3, "gemv")


@both_rigs
@pytest.mark.parametrize("qt", sorted(kgemv.KERNEL_TYPES), ids=lambda q: QType(q).name)
def test_embed_rms(rig, qt):
    """The embedding row of a token dequantized into every stream, then the first read's grouped norm."""
    rng = np.random.default_rng(int(qt))
    hc, vocab = 3, 29
    E = kgemv.BLOCKS[qt][0] * 2 if qt not in kgemv.FLOAT_TYPES else 100
    raw = random_matrix(qt, vocab, E, rng)
    table = rig.mat("table", raw, qt, vocab, E)
    token = 17
    step = rig.buf("step", (STEP_N,), np.int32, step_words(tokens=(token,)))
    norm = (1 + 0.1 * rng.standard_normal((hc, E))).astype(F32)
    nb = rig.buf("norm", (hc, E), value=norm)
    R, xn = rig.buf("R", (hc, E)), rig.buf("xn", (hc, E))
    rig.commit()
    rig.poison(R, xn)
    rig.run(kgemv.embed_launch(rig.k.fn("gemv", "embed_rms"), "embed", table, step, R, nb, xn, hc, 1e-6))
    row = dequantize(raw, qt).reshape(vocab, E)[token]
    Rr = np.repeat(row[None], hc, 0)
    assert rel(R.download(), Rr) <= 1e-6
    assert rel(xn.download(), rms_norm(Rr, norm, 1e-6)) <= TOL


@both_rigs
def test_host_copy(rig):
    """host_copy: words from mapped pinned host memory into the arena at an offset, every word of the range (a
    partial last CTA), nothing around it; a replay reads the host bytes as they are then."""
    n, off = 700, 12                                    # 700 words: 3 CTAs, the last one part-filled
    dst = rig.buf("dst", (n + 2 * off,), np.int32)
    rig.commit()
    host = drv.HostBuffer(4 * (n + 8), mapped=True, what="test host copy")
    try:
        src = host.array(np.int32, (n + 8,))
        src[:] = np.arange(n + 8, dtype=np.int32) * 7 - 1000
        launch = kgemv.host_copy_launch(rig.k.fn("gemv", "host_copy"), "copy", dst, host.dptr + 16, 4 * n, 4 * off)
        rig.poison(dst)
        rig.run(launch)
        got = dst.download()
        assert (got[off:off + n] == src[4:4 + n]).all()
        assert (got[:off] == -7).all() and (got[off + n:] == -7).all()
        src[:] = -src                                       # the same launch again: the new bytes
        rig.run(launch)
        assert (dst.download()[off:off + n] == src[4:4 + n]).all()
        with pytest.raises(ValueError, match="overrun"):
            kgemv.host_copy_launch(rig.k.fn("gemv", "host_copy"), "copy", dst, host.dptr, 4 * n, 4 * (2 * off + 1))
    finally:
        host.free()


# ---- the gated residual -----------------------------------------------------------------------------------

def _hc_weights(rng, hc, E, r, qt=QType.Q8_0):
    """down (r, hc*E), up (hc*E, r), inject (hc, hc*E) as random blocks of qt (rows must hold whole blocks)."""
    out = {}
    for name, (n_out, n_in) in {"down": (r, hc * E), "up": (hc * E, r), "inject": (hc, hc * E)}.items():
        t = qt if n_in % kgemv.BLOCKS[qt][0] == 0 else QType.F32
        raw = random_matrix(t, n_out, n_in, rng, 1 / (64 * np.sqrt(n_in)) if t != QType.F32 else 1 / np.sqrt(n_in))
        out[name] = (raw, t, n_out, n_in, dequantize(raw, t).reshape(n_out, n_in))
    return out


@both_rigs
@pytest.mark.parametrize("hc,E,r", [(4, 100, 12), (3, 256, 64), (4, 2560, 320)])
def test_gr_read(rig, hc, E, r):
    """rms_group -> GEMV(down, inject) -> up_mix against strata.reference.hc.gr_read."""
    rng = np.random.default_rng(E)
    Rv = rng.standard_normal((hc, E)).astype(F32)
    norm = (1 + 0.2 * rng.standard_normal((hc, E))).astype(F32)
    w = _hc_weights(rng, hc, E, r)
    R, nb = rig.buf("R", (hc, E), value=Rv), rig.buf("norm", (hc, E), value=norm)
    xn, lo, inj, mixed = rig.buf("xn", (hc, E)), rig.buf("lo", (r,)), rig.buf("inj", (hc,)), rig.buf("mixed", (E,))
    m = {k: rig.mat(k, v[0], v[1], v[2], v[3]) for k, v in w.items()}
    table = kgemv.job_table("jobs", 2, rig.A.reserve)
    rig.commit()
    k = rig.k
    launches = [khc.rms_group_launch(k.fn("hc", "rms_group"), "rms", R, nb, xn, hc, E, 1e-6),
                kgemv.gemv_launch(k.fn("gemv", "gemv_jobs"), "down", table, [Job(m["down"], xn, lo),
                                                                              Job(m["inject"], xn, inj)]),
                khc.up_mix_launch(k.fn("hc", "up_mix"), "up", m["up"], lo, xn, mixed, hc, E)]
    rig.poison(xn, lo, inj, mixed)
    rig.run(*launches)
    ref_mixed, ref_inj = gr_read(Rv[None], norm, Rows(w["down"][4]), Rows(w["up"][4]), Rows(w["inject"][4]), 1e-6)
    ref_mixed, ref_inj = ref_mixed[0], ref_inj[0]
    assert rel(xn.download(), rms_norm(Rv, norm, 1e-6)) <= TOL
    assert rel(mixed.download(), ref_mixed) <= TOL
    with np.errstate(over="ignore"):                          # the kernels keep the raw logit; writers apply this
        got_inj = 2 / (1 + np.exp(-inj.download().astype(np.float64) / hc))
    assert rel(got_inj, ref_inj) <= TOL


@both_rigs
def test_up_mix_every_geometry(rig):
    """Every up_mix tile geometry computes the same gated mean (the pick is then a question of speed only: the
    sweep in bench/gpu_check.py --phases gemv --sweep), at the flash shape's rank and a short E."""
    rng = np.random.default_rng(11)
    hc, E, r = 4, 300, 320
    w = _hc_weights(rng, hc, E, r)
    lo_raw = (rng.standard_normal(r) * 3).astype(F32)
    xv = rng.standard_normal((hc, E)).astype(F32)
    lo, xn, mixed = rig.buf("lo", (r,), value=lo_raw), rig.buf("xn", (hc, E), value=xv), rig.buf("mixed", (E,))
    up = rig.mat("up", *w["up"][:4])
    rig.commit()
    U, lv = w["up"][4].astype(np.float64), lo_raw.astype(np.float64) / hc
    g = 1 / (1 + np.exp(-(U @ (lv / (1 + np.exp(-lv)))))).reshape(hc, E)
    ref = (g * xv).mean(axis=0)
    geoms = list(khc.up_mix_geoms(up.row_bytes, hc, E))
    assert {g.nt for g in geoms} == {64, 128, 256}
    for geom in geoms:
        rig.poison(mixed)
        rig.run(khc.up_mix_launch(rig.k.fn("hc", "up_mix"), "up", up, lo, xn, mixed, hc, E, geom))
        assert rel(mixed.download(), ref) <= TOL, f"nt {geom.nt} tpg {geom.tpg}: {rel(mixed.download(), ref):.2e}"


@both_rigs
@pytest.mark.parametrize("rows,hc,E", [(1, 4, 333), (3, 4, 2560), (2, 1, 40)])
def test_write_rms(rig, rows, hc, E):
    """gr_write and the next norm over a cluster of CTAs a row: slices of E that do not divide evenly, several
    rows, one stream, and slices shorter than a warp."""
    rng = np.random.default_rng(3 + rows)
    Rv, out = rng.standard_normal((rows, hc, E)).astype(F32), rng.standard_normal((rows, E)).astype(F32)
    inj_raw = rng.standard_normal((rows, hc)).astype(F32)
    norm = (1 + 0.2 * rng.standard_normal((hc, E))).astype(F32)
    R = rig.buf("R", (rows, hc, E), value=Rv)
    ib, ob, nb, xn = (rig.buf("inj", (rows, hc), value=inj_raw), rig.buf("out", (rows, E), value=out),
                      rig.buf("norm", (hc, E), value=norm), rig.buf("xn", (rows, hc, E)))
    rig.commit()
    rig.poison(xn)
    rig.run(khc.write_rms_launch(rig.k.fn("hc", "write_rms"), "write", R, ib, ob, nb, xn, hc, E, 1e-6, rows))
    inject = (2 / (1 + np.exp(-inj_raw / hc))).astype(F32)
    Rn = gr_write(Rv, inject, out)
    assert rel(R.download(), Rn) <= TOL
    assert rel(xn.download(), rms_norm(Rn, norm, 1e-6)) <= TOL


# ---- GDN ---------------------------------------------------------------------------------------------------

def _gdn_weights(rng, cfg) -> SimpleNamespace:
    """A GDN layer's f32 weights, ssm_out the identity (the kernels' output is y)."""
    E, K, cd, vd, Hv, D = cfg.n_embd, cfg.ssm_conv, cfg.conv_dim, cfg.value_dim, cfg.ssm_v_heads, cfg.ssm_state
    return SimpleNamespace(
        attn_qkv=(rng.standard_normal((cd, E)) / np.sqrt(E)).astype(F32),
        attn_gate=(rng.standard_normal((vd, E)) / np.sqrt(E)).astype(F32),
        ssm_beta=(rng.standard_normal((Hv, E)) / np.sqrt(E)).astype(F32),
        ssm_alpha=(rng.standard_normal((Hv, E)) / np.sqrt(E)).astype(F32),
        ssm_dt=(0.5 * rng.standard_normal(Hv)).astype(F32), ssm_a=-rng.uniform(0.01, 4, Hv).astype(F32),
        ssm_conv1d=(0.5 * rng.standard_normal((cd, K))).astype(F32),
        ssm_norm=(1 + 0.2 * rng.standard_normal(D)).astype(F32), ssm_out=np.eye(E, vd, dtype=F32))


@both_rigs
@pytest.mark.parametrize("Hk,Hv,D", [(2, 6, 16), (3, 3, 24), (2, 4, 128)])
def test_gdn_core(rig, Hk, Hv, D):
    """gdn_core over 7 tokens (the conv ring wraps) against gdn_chunk one token a step, with ssm_out = identity so
    its output is y."""
    rng = np.random.default_rng(D + Hv)
    cfg = cfg_tiny(ssm_k_heads=Hk, ssm_v_heads=Hv, ssm_state=D, n_embd=Hv * D)
    E, K, cd, vd = cfg.n_embd, cfg.ssm_conv, cfg.conv_dim, cfg.value_dim
    w = _gdn_weights(rng, cfg)
    st = GdnState.zeros(cfg)
    qkv, z, al, be = rig.buf("qkv", (cd,)), rig.buf("z", (vd,)), rig.buf("alpha", (Hv,)), rig.buf("beta", (Hv,))
    cw, dt, A, nw = (rig.buf("conv", (cd, K), value=w.ssm_conv1d), rig.buf("dt", (Hv,), value=w.ssm_dt),
                     rig.buf("A", (Hv,), value=w.ssm_a), rig.buf("norm", (D,), value=w.ssm_norm))
    ring, S, y, step = (rig.buf("ring", (K, cd)), rig.buf("S", (Hv, D, D)), rig.buf("y", (vd,)),
                        rig.buf("step", (STEP_N,), np.int32))
    rig.commit()
    launch = kgdn.gdn_core_launch(rig.k.fn("gdn", "gdn_core"), "gdn", cfg, qkv, z, al, be, cw, dt, A, nw, ring, S, y,
                                  step)
    for t in range(7):
        x = rng.standard_normal(E).astype(F32)
        for buf, v in ((qkv, w.attn_qkv @ x), (z, w.attn_gate @ x), (al, w.ssm_alpha @ x), (be, w.ssm_beta @ x)):
            buf.upload(v.astype(F32))
        step.upload(step_words(pos=t))
        rig.poison(y)
        rig.run(launch)
        ref = gdn_chunk(cfg, as_rows(w, "attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out"), [(st, 0, 1)],
                        x[None])[0]
        assert rel(y.download(), ref) <= TOL, f"t={t}"
        assert rel(S.download(), st.S) <= TOL, f"state t={t}"
        got_conv = ring.download()[[(t - (K - 2) + j) % K for j in range(K - 1)]]   # positions t-2 .. t, oldest first
        assert rel(got_conv, st.conv) <= TOL


@both_rigs
@pytest.mark.parametrize("Hk,Hv,D", [(2, 6, 16), (3, 3, 24), (2, 4, 128)])
def test_gdn_chunk(rig, Hk, Hv, D):
    """gdn_conv, gdn_prep, gdn_scan and gdn_out over chunks of 5, 1, 6 and 37 rows (the ring wraps inside and across
    chunks; gdn_scan's 16-row stages end inside the last chunk) against the reference's chunk path, state and conv
    ring included."""
    rng = np.random.default_rng(D + Hv + 1)
    cfg = cfg_tiny(ssm_k_heads=Hk, ssm_v_heads=Hv, ssm_state=D, n_embd=Hv * D)
    E, K, cd, vd, Tm = cfg.n_embd, cfg.ssm_conv, cfg.conv_dim, cfg.value_dim, 37
    w = _gdn_weights(rng, cfg)
    st = GdnState.zeros(cfg)
    qkv, z, al, be = (rig.buf("qkv", (Tm, cd)), rig.buf("z", (Tm, vd)), rig.buf("alpha", (Tm, Hv)),
                      rig.buf("beta", (Tm, Hv)))
    cw, dt, A, nw = (rig.buf("conv", (cd, K), value=w.ssm_conv1d), rig.buf("dt", (Hv,), value=w.ssm_dt),
                     rig.buf("A", (Hv,), value=w.ssm_a), rig.buf("norm", (D,), value=w.ssm_norm))
    ring, S, y, c = rig.buf("ring", (K, cd)), rig.buf("S", (Hv, D, D)), rig.buf("y", (Tm, vd)), rig.buf("c", (Tm, cd))
    qn, kn, bt, eg, o = (rig.buf("qn", (Tm, Hk, D)), rig.buf("kn", (Tm, Hk, D)), rig.buf("bt", (Tm, Hv)),
                         rig.buf("eg", (Tm, Hv)), rig.buf("o", (Tm, vd)))
    step = rig.buf("step", (STEP_N,), np.int32)
    rig.commit()
    fn = lambda n: rig.k.fn("gdn", n)
    conv = kgdn.gdn_conv_launch(fn("gdn_conv"), "conv", cfg, qkv, cw, ring, c, step, Tm)
    core = (kgdn.gdn_prep_launch(fn("gdn_prep"), "prep", cfg, c, qkv, al, be, dt, A, qn, kn, bt, eg, ring, step, Tm),
            kgdn.gdn_scan_launch(fn("gdn_scan"), "scan", cfg, qn, kn, c, bt, eg, S, o, step, Tm),
            kgdn.gdn_out_launch(fn("gdn_out"), "out", cfg, o, z, nw, y, step, Tm))
    pos = 0
    for T in (5, 1, 6, 37):
        x = rng.standard_normal((T, E)).astype(F32)
        for buf, m in ((qkv, w.attn_qkv), (z, w.attn_gate), (al, w.ssm_alpha), (be, w.ssm_beta)):
            v = np.zeros((Tm, m.shape[0]), F32)
            v[:T] = x @ m.T
            buf.upload(v)
        step.upload(step_words(pos=pos, rows=T))
        rig.poison(y)
        rig.run(conv, *core)
        ref = gdn_chunk(cfg, as_rows(w, "attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out"), [(st, 0, T)], x)
        assert rel(y.download()[:T], ref) <= TOL, f"chunk at {pos}"
        assert np.isnan(y.download()[T:]).all()
        assert rel(S.download(), st.S) <= TOL, f"state after {pos + T}"
        t = pos + T - 1
        got_conv = ring.download()[[(t - (K - 2) + j) % K for j in range(K - 1)]]
        assert rel(got_conv, st.conv) <= TOL
        pos += T


@both_rigs
@pytest.mark.parametrize("Hk,Hv,D", [(2, 4, 128), (3, 3, 24), (2, 2, 18)])
@pytest.mark.parametrize("T", [37, 32, 1])
def test_gdn_scan_stages(rig, Hk, Hv, D, T):
    """gdn_scan alone (its rows' inputs staged through shared memory, 16 rows a stage) against the reference's
    delta rule on the same normalized inputs, at chunks ending inside a stage, on its boundary and after one row,
    from a non-zero state; D = 24 leaves the second column block half empty, D = 18 copies 4 bytes at a time (rows
    not a multiple of 16 bytes)."""
    rng = np.random.default_rng(D * 100 + T)
    cfg = cfg_tiny(ssm_k_heads=Hk, ssm_v_heads=Hv, ssm_state=D, n_embd=Hv * D)
    cd, vd, kd = cfg.conv_dim, cfg.value_dim, cfg.key_dim
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    q_v = (unit(rng.standard_normal((T, Hk, D))) / np.sqrt(D)).astype(F32)
    k_v = unit(rng.standard_normal((T, Hk, D))).astype(F32)
    c_v, S0 = rng.standard_normal((T, cd)).astype(F32), rng.standard_normal((Hv, D, D)).astype(F32)
    bt_v, eg_v = rng.uniform(0, 1, (T, Hv)).astype(F32), rng.uniform(0.3, 1, (T, Hv)).astype(F32)
    qn, kn = rig.buf("qn", (T, Hk, D), value=q_v), rig.buf("kn", (T, Hk, D), value=k_v)
    c = rig.buf("c", (T, cd), value=c_v)
    bt, eg = rig.buf("bt", (T, Hv), value=bt_v), rig.buf("eg", (T, Hv), value=eg_v)
    S, o, step = rig.buf("S", (Hv, D, D), value=S0), rig.buf("o", (T, vd)), rig.buf("step", (STEP_N,), np.int32)
    rig.commit()
    step.upload(step_words(pos=5, rows=T))
    rig.poison(o)
    rig.run(kgdn.gdn_scan_launch(rig.k.fn("gdn", "gdn_scan"), "scan", cfg, qn, kn, c, bt, eg, S, o, step, T))
    kh = np.arange(Hv) % Hk
    S_ref, o_ref = S0.copy(), np.empty((T, Hv, D), F32)
    delta_rule(S_ref, np.ascontiguousarray(q_v[:, kh]), np.ascontiguousarray(k_v[:, kh]),
               np.ascontiguousarray(c_v[:, 2 * kd:].reshape(T, Hv, D)), eg_v, bt_v, o_ref)
    assert rel(o.download(), o_ref.reshape(T, vd)) <= TOL
    assert rel(S.download(), S_ref) <= TOL


# ---- QSA ---------------------------------------------------------------------------------------------------

def _qsa_rig(rig, cfg, rng, max_ctx, nsplit):
    H, Hkv, D, Hi, Di, E = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.idx_heads, cfg.idx_dim, cfg.n_embd
    il = 3
    ratio = cfg.compress_ratios[il]
    m = lambda o, i: (rng.standard_normal((o, i)) / np.sqrt(i)).astype(F32)
    w = SimpleNamespace(attn_q=m(2 * H * D, E), attn_k=m(Hkv * D, E), attn_v=m(Hkv * D, E), attn_output=m(E, H * D),
                        indexer_q_proj=m(Hi * Di, E), indexer_k_proj=m(Di, E),
                        attn_q_norm=(1 + 0.2 * rng.standard_normal(D)).astype(F32),
                        attn_k_norm=(1 + 0.2 * rng.standard_normal(D)).astype(F32),
                        indexer_q_norm=(1 + 0.2 * rng.standard_normal(Di)).astype(F32),
                        indexer_k_norm=(1 + 0.2 * rng.standard_normal(Di)).astype(F32))
    b = SimpleNamespace()
    b.x = rig.buf("x", (E,))
    b.qg, b.kr, b.vr = rig.buf("qg", (2 * H * D,)), rig.buf("kr", (Hkv * D,)), rig.buf("vr", (Hkv * D,))
    b.iqr, b.ikr = rig.buf("iqr", (Hi * Di,)), rig.buf("ikr", (Di,))
    norms = [rig.buf(n, v.shape, value=v) for n, v in (("qn", w.attn_q_norm), ("kn", w.attn_k_norm),
                                                       ("iqn", w.indexer_q_norm), ("ikn", w.indexer_k_norm))]
    b.inv = rig.buf("inv_freq", (cfg.n_rot // 2,), value=rope_inv_freq(cfg.n_rot, cfg.rope_base))
    b.q, b.iq = rig.buf("q", (H, D)), rig.buf("iq", (Hi, Di))
    b.Kc, b.Vc = rig.buf("Kc", (max_ctx, Hkv, D)), rig.buf("Vc", (max_ctx, Hkv, D))
    b.idx_raw, b.idx_blk = rig.buf("idx_raw", (max_ctx, Di)), rig.buf("idx_blk", (max_ctx // ratio, Di))
    b.scores, b.sel, b.meta = (rig.buf("scores", (max_ctx // ratio,)), rig.buf("sel", (max_ctx // ratio,), np.int32),
                               rig.buf("meta", (2,), np.int32))
    b.part, b.att, b.out = rig.buf("part", (H, nsplit, D + 2)), rig.buf("att", (H * D,)), rig.buf("out", (E,))
    b.step = rig.buf("step", (STEP_N,), np.int32)
    mats = {k: rig.mat(k, getattr(w, k).view(np.uint8), QType.F32, *getattr(w, k).shape)
            for k in ("attn_q", "attn_k", "attn_v", "indexer_q_proj", "indexer_k_proj", "attn_output")}
    t_proj, t_out = kgemv.job_table("proj", 5, rig.A.reserve), kgemv.job_table("out", 1, rig.A.reserve)
    rig.commit()
    k, n_sm = rig.k, rig.dev.n_sm
    launches = [
        kgemv.gemv_launch(k.fn("gemv", "gemv_jobs"), "proj", t_proj,
                          [Job(mats["attn_q"], b.x, b.qg), Job(mats["attn_k"], b.x, b.kr), Job(mats["attn_v"], b.x, b.vr),
                           Job(mats["indexer_q_proj"], b.x, b.iqr), Job(mats["indexer_k_proj"], b.x, b.ikr)]),
        kqsa.prep_launch(k.fn("qsa", "qsa_prep"), "prep", cfg, il, b.qg, b.kr, b.vr, b.iqr, b.ikr, *norms, b.inv, b.q,
                         b.Kc, b.Vc, b.iq, b.idx_raw, b.idx_blk, b.step, max_ctx),
        kqsa.score_launch(k.fn("qsa", "qsa_score"), "score", cfg, il, b.iq, b.idx_blk, b.scores, b.step, max_ctx, n_sm),
        kqsa.select_launch(k.fn("qsa", "qsa_select"), "select", cfg, il, b.scores, b.sel, b.meta, b.step, max_ctx),
        kqsa.attn_launch(lambda n: k.fn("qsa", n), "attn", cfg, il, b.q, b.Kc, b.Vc, b.sel, b.meta, b.part, b.step,
                         max_ctx, nsplit),
        kqsa.combine_launch(k.fn("qsa", "qsa_combine"), "combine", cfg, b.part, b.qg, b.att, nsplit, b.step),
        kgemv.gemv_launch(k.fn("gemv", "gemv_jobs"), "out", t_out, [Job(mats["attn_output"], b.att, b.out)])]
    return w, b, launches, il


@both_rigs
@pytest.mark.parametrize("geom", ["tiny", "flash_heads"])
def test_qsa_layer(rig, geom):
    """The QSA kernels in order, token by token past 4x the budget, against qsa_chunk one token a step (dense then
    sparse)."""
    rng = np.random.default_rng(11)
    if geom == "tiny":
        cfg, n_tok = cfg_tiny(n_embd=72), 50
    else:
        cfg, n_tok = cfg_tiny(n_embd=96, n_head=24, n_head_kv=2, head_dim=256, n_rot=64, idx_heads=4, idx_dim=128,
                              idx_budget=16), 40
    max_ctx, nsplit = 64, 7
    w, b, launches, il = _qsa_rig(rig, cfg, rng, max_ctx, nsplit)
    st, inv = QsaState.empty(cfg), rope_inv_freq(cfg.n_rot, cfg.rope_base)
    sparse = 0
    wr = as_rows(w, "attn_q", "attn_k", "attn_v", "attn_output", "indexer_q_proj", "indexer_k_proj")
    Hi, Di, ratio = cfg.idx_heads, cfg.idx_dim, cfg.compress_ratios[il]
    for t in range(n_tok):
        x = rng.standard_normal(cfg.n_embd).astype(F32)
        b.x.upload(x)
        b.step.upload(step_words(pos=t))
        rig.poison(b.out, b.att, b.q)
        rig.run(*launches)
        ref = qsa_chunk(cfg, il, wr, [(st, 0, 1)], x[None], np.array([t]), inv)[0]
        assert rel(b.out.download(), ref) <= TOL, f"t={t}"
        nb = (t + 1) // ratio
        if nb > cfg.block_topk(il):
            sparse += 1
            iq = rope(rms_norm((w.indexer_q_proj @ x).reshape(1, Hi, Di), w.indexer_q_norm, cfg.rms_eps),
                      np.array([t]), inv)
            assert rel(b.scores.download()[:nb], block_scores(cfg, iq, st.idx_blocks.view()[:nb])[0]) <= TOL
    assert rel(b.idx_blk.download()[:st.idx_blocks.n], st.idx_blocks.view()) <= TOL
    assert sparse > n_tok // 2


@both_rigs
@pytest.mark.parametrize("H,Hkv,D,nsplit", [(24, 2, 256, 2), (4, 2, 24, 1), (40, 2, 18, 3), (4, 1, 130, 2)],
                         ids=["flash-heads", "D24", "group20-D18", "D130"])
@pytest.mark.parametrize("tc", [False, True], ids=["fma", "tc"])
def test_qsa_attn_cells(rig, H, Hkv, D, nsplit, tc):
    """qsa_attn (the token's) or qsa_attn_tc (the batched step's, tensor cores) and qsa_combine alone over long cell
    lists (10-60 rounds of 8 cells a split, so the softmax's running maximum moves between rounds), two rows at
    different positions, each its own selected blocks and incomplete tail, against float64 attention over the same
    cells; D = 18 copies 4 bytes at a time, 20 heads a kv head take 5 warps (qsa_attn) or two CTAs of 16 heads, the
    second 4 of them (qsa_attn_tc), D = 18 and 24 leave padded dims in qsa_attn_tc's k-steps, and D = 130 (4-byte
    copies, more a cell than qsa_attn_tc has threads) takes its general copy loop."""
    rng = np.random.default_rng(H + D)
    ratio, max_ctx, rows, pos = 4, 1024, 2, 700
    cfg = cfg_tiny(n_head=H, n_head_kv=Hkv, head_dim=D, n_rot=8, idx_budget=512, compress_ratios=(0, 0, 0, ratio))
    il, ld = 3, max_ctx // ratio
    q = rng.standard_normal((rows, H, D)).astype(F32)
    Kc = (2 * rng.standard_normal((max_ctx, Hkv, D))).astype(F32)      # scores of a few units: a peaked softmax
    Vc = rng.standard_normal((max_ctx, Hkv, D)).astype(F32)
    gate = rng.standard_normal((rows, H, D)).astype(F32)
    sel, meta, cells = np.full((rows, ld), -1, np.int32), np.zeros((rows, 2), np.int32), []
    for r in range(rows):
        t = pos + r
        nb, tail = (t + 1) // ratio, (t + 1) % ratio
        k = 100 + 25 * r                                                  # selected blocks: 400-500 cells
        blocks = np.sort(rng.choice(nb, k, replace=False)).astype(np.int32)
        sel[r, :k] = blocks
        meta[r] = k, k * ratio + tail
        cells.append(np.concatenate([(blocks[:, None] * ratio + np.arange(ratio)).ravel(),
                                     nb * ratio + np.arange(tail)]))
    qg = np.concatenate([q, gate], axis=2)                               # per head [q | gate]
    b = SimpleNamespace(q=rig.buf("q", (rows, H, D), value=q), Kc=rig.buf("Kc", Kc.shape, value=Kc),
                        Vc=rig.buf("Vc", Vc.shape, value=Vc), sel=rig.buf("sel", sel.shape, np.int32, sel),
                        meta=rig.buf("meta", meta.shape, np.int32, meta), part=rig.buf("part", (rows, H, nsplit, D + 2)),
                        qg=rig.buf("qg", qg.shape, value=qg), y=rig.buf("y", (rows, H * D)),
                        step=rig.buf("step", (STEP_N,), np.int32, step_words(pos=pos, rows=rows)))
    rig.commit()
    rig.poison(b.part, b.y)
    rig.run(kqsa.attn_launch(lambda n: rig.k.fn("qsa", n), "attn", cfg, il, b.q, b.Kc,
                             b.Vc, b.sel, b.meta, b.part, b.step, max_ctx, nsplit, rows, ld, tc=tc),
            kqsa.combine_launch(rig.k.fn("qsa", "qsa_combine"), "combine", cfg, b.part, b.qg, b.y, nsplit, b.step,
                                rows))
    got = b.y.download().reshape(rows, H, D)
    group = H // Hkv
    for r in range(rows):
        for h in range(H):
            K, V = Kc[cells[r], h // group].astype(np.float64), Vc[cells[r], h // group].astype(np.float64)
            s = K @ q[r, h].astype(np.float64) / np.sqrt(D)
            p = np.exp(s - s.max())
            ref = (p @ V) / p.sum() / (1 + np.exp(-gate[r, h].astype(np.float64)))
            assert rel(got[r, h], ref) <= TOL, f"row {r} head {h}"


@both_rigs
def test_qsa_select_ties(rig):
    """Top-k with many exact ties at the cut: lower block indices win, like select_blocks."""
    cfg = cfg_tiny(idx_budget=40)                 # top 10 blocks of ratio 4
    il, ratio, max_ctx = 3, 4, 4096
    scores = rig.buf("scores", (max_ctx // ratio,))
    sel, meta, step = (rig.buf("sel", (max_ctx // ratio,), np.int32), rig.buf("meta", (2,), np.int32),
                       rig.buf("step", (STEP_N,), np.int32))
    rig.commit()
    launch = kqsa.select_launch(rig.k.fn("qsa", "qsa_select"), "select", cfg, il, scores, sel, meta, step, max_ctx)
    rng = np.random.default_rng(2)
    for t in (39, 41, 402, 1001, 4095):
        nb = (t + 1) // ratio
        s = rng.integers(0, 6, nb).astype(F32) * 0.25          # few distinct values: ties everywhere
        scores.upload(np.pad(s, (0, max_ctx // ratio - nb), constant_values=np.nan))
        step.upload(step_words(pos=t))
        rig.poison(sel, meta)
        rig.run(launch)
        n_sel, n_cells = meta.download()
        want = select_blocks(s, cfg.block_topk(il)) if nb > cfg.block_topk(il) else np.arange(nb)
        assert n_sel == len(want) and n_cells == len(want) * ratio + (t + 1 - nb * ratio)
        assert np.array_equal(sel.download()[:n_sel], want), f"t={t}"


# ---- MoE ---------------------------------------------------------------------------------------------------

@both_rigs
def test_route_and_doorbell(rig):
    from strata.cuda.doorbell import Doorbell
    rng = np.random.default_rng(4)
    cfg = cfg_tiny(n_expert=512, n_expert_used=10, n_embd=2560)
    E, n, k = cfg.n_embd, cfg.n_expert, cfg.n_expert_used
    logits, x = rig.buf("logits", (n,)), rig.buf("x", (E,))
    ids, wts, step = rig.buf("ids", (k,), np.int32), rig.buf("wts", (k,)), rig.buf("step", (STEP_N,), np.int32)
    ticket = rig.buf("ticket", (1,), np.uint32)
    rig.commit()
    db = Doorbell(E, k)
    try:
        launch = kmoe.route_launch(rig.k.fn("moe", "moe_route"), "route", cfg, 5, logits, x, ids, wts, step, db.ptrs,
                                   ticket)
        for ring, flags in ((100, 1), (200, 1), (300, 0)):        # flags 0: the payload without x
            w = SimpleNamespace(ffn_gate_inp=Rows(np.eye(n, dtype=F32)))
            lv = rng.standard_normal(n).astype(F32) * 3
            lv[7] = lv[300] = lv.max() + 1                     # a tie in the top 10: the lower id first
            xv = rng.standard_normal(E).astype(F32)
            logits.upload(lv)
            x.upload(xv)
            step.upload(step_words(ring=ring, flags=flags))
            rig.poison(ids, wts)
            db.x[:] = np.nan
            rig.run(launch)
            ref_ids, ref_w = (a[0] for a in route(cfg, w, lv[None]))
            assert np.array_equal(ids.download(), ref_ids)
            assert rel(wts.download(), ref_w) <= TOL
            assert db.value() == ring + 5
            dx, di, dw = (a[0] for a in db.payload())
            assert np.array_equal(di, ref_ids) and rel(dw, ref_w) <= TOL
            assert np.array_equal(dx, xv) if flags else np.isnan(dx).all()
            assert db.payload(x=False)[0] is None
    finally:
        db.free()


@both_rigs
@pytest.mark.parametrize("qt", [QType.Q2_0, QType.Q4_K, QType.F32])
def test_experts(rig, qt):
    """gate/up GLU and down over k selected experts at their slots; slot -1 rows are the host's, left unwritten."""
    rng = np.random.default_rng(int(qt))
    E, Fn = (256, 256) if qt == QType.Q4_K else ((128, 192) if qt == QType.Q2_0 else (100, 20))
    cfg = cfg_tiny(n_embd=E, n_ff_exp=Fn, n_expert=6, n_expert_used=4)
    n_slot = 5
    sc = (lambda n: 1 / np.sqrt(n)) if qt == QType.F32 else (lambda n: 1 / (64 * np.sqrt(n)))
    g_raw, u_raw, d_raw = (random_matrix(qt, n_slot * Fn, E, rng, sc(E)), random_matrix(qt, n_slot * Fn, E, rng, sc(E)),
                           random_matrix(qt, n_slot * E, Fn, rng, sc(Fn)))
    G, U, Dn = (dequantize(g_raw, qt).reshape(n_slot, Fn, E), dequantize(u_raw, qt).reshape(n_slot, Fn, E),
                dequantize(d_raw, qt).reshape(n_slot, E, Fn))
    gm, um, dm = (rig.mat("gate", g_raw, qt, Fn, E, n_slot), rig.mat("up", u_raw, qt, Fn, E, n_slot),
                  rig.mat("down", d_raw, qt, E, Fn, n_slot))
    bank = kmoe.ExpertBank(gm, 0, um, 0, dm, 0, (gm.mat_bytes, um.mat_bytes, dm.mat_bytes))
    slots_v = np.array([3, -1, 0, 4], np.int32)
    xv = rng.standard_normal(E).astype(F32)
    job, slots = rig.buf("job", (kmoe.MOE_JOB_DTYPE.itemsize,), np.uint8), rig.buf("slots", (4,), np.int32, slots_v)
    x, h, out = rig.buf("x", (E,), value=xv), rig.buf("h", (4, kmoe.padded_ff(cfg))), rig.buf("out", (4, E))
    # the mapped token's path: an address table per expert id; ids 1 and 5 live in mapped pinned host memory
    ids_v = np.array([3, 1, 0, 5], np.int32)
    job_m, ids = rig.buf("job_m", (kmoe.MOE_JOB_DTYPE.itemsize,), np.uint8), rig.buf("ids", (4,), np.int32, ids_v)
    ptab = rig.buf("ptab", (cfg.n_expert, 3), np.uint64)
    lay = kmoe.FetchLayout(gm.mat_bytes, um.mat_bytes, dm.mat_bytes)
    stage, eff = rig.buf("stage", (4 * lay.stride,), np.uint8), rig.buf("eff", (4, 3), np.uint64)
    job_f = rig.buf("job_f", (kmoe.MOE_JOB_DTYPE.itemsize,), np.uint8)
    # a prefetch of predicted ids (5 a miss, 3 0 2 in VRAM) into its own staging, which the fetch then reuses
    pre_v = np.array([5, 3, 0, 2], np.int32)
    pre_ids, pre_eff = rig.buf("pre_ids", (4,), np.int32, pre_v), rig.buf("pre_eff", (4, 3), np.uint64)
    pre_stage = rig.buf("pre_stage", (5 * lay.stride,), np.uint8)
    # a prediction wider than the route (prefetch_extra 1): both misses, 5 and 1, among its five
    wide_v = np.array([5, 3, 0, 2, 1], np.int32)
    wide_ids, wide_eff = rig.buf("wide_ids", (5,), np.int32, wide_v), rig.buf("wide_eff", (5, 3), np.uint64)
    rig.commit()
    gu, dn = kmoe.expert_launches(rig.k.fn("moe", "moe_gate_up"), rig.k.fn("moe", "moe_down"), "experts", cfg, job,
                                  bank, slots, x, h, out)
    rig.poison(h, out)
    rig.run(gu, dn)
    got = out.download()
    for j, s in enumerate(slots_v):
        if s < 0:
            assert np.isnan(got[j]).all(), "a host expert's row was written"
            continue
        ref = expert_ffn(G[s].astype(np.float64), U[s].astype(np.float64), Dn[s].astype(np.float64), xv)
        assert rel(got[j], ref) <= TOL, f"expert slot {s}: {rel(got[j], ref):.2e}"
    mats = [(g_raw, gm), (u_raw, um), (d_raw, dm)]
    rows = lambda raw, m, e: device_rows(raw, qt, m.n_out * m.n_mat, m.n_in).reshape(m.n_mat, -1)[e]   # as rig.mat
    host = drv.HostBuffer(2 * sum(m.mat_bytes for m in (gm, um, dm)) + 4096, mapped=True, what="test experts")
    try:
        table, at = np.zeros((cfg.n_expert, 3), np.uint64), 0
        for e, src in ((0, 0), (3, 3), (1, 2), (5, 4), (2, 1)):     # expert id -> the slot whose weights it has
            for p, (raw, m) in enumerate(mats):
                if e in (1, 5):                # from host memory; parts 16-aligned (the tiles' vector reads)
                    at += 16 * (p + 1)
                    host.array(np.uint8, (m.mat_bytes,), at)[:] = rows(raw, m, src)
                    table[e, p] = host.dptr + at
                    at += m.mat_bytes
                else:
                    table[e, p] = m.ptr + src * m.mat_bytes
        ptab.upload(table)
        gu, dn = kmoe.expert_launches(rig.k.fn("moe", "moe_gate_up"), rig.k.fn("moe", "moe_down"), "experts mapped",
                                      cfg, job_m, bank, ids, x, h, out, ptab)
        rig.poison(h, out)
        rig.run(gu, dn)
        got = out.download()
        for j, s in enumerate([3, 2, 0, 4]):
            ref = expert_ffn(G[s].astype(np.float64), U[s].astype(np.float64), Dn[s].astype(np.float64), xv)
            assert rel(got[j], ref) <= TOL, f"mapped expert {ids_v[j]}: {rel(got[j], ref):.2e}"
        # the same with the misses fetched into VRAM staging first: the same bytes reach the same tiles
        lo, hi = rig.A.base, rig.A.base + rig.A.total
        fetch = kmoe.fetch_launch(rig.k.fn("moe", "moe_fetch"), "fetch", cfg, ptab, ids, eff, stage, lay, lo, hi,
                                  2 * rig.dev.n_sm)
        gu, dn = kmoe.expert_launches(rig.k.fn("moe", "moe_gate_up"), rig.k.fn("moe", "moe_down"), "experts fetched",
                                      cfg, job_f, bank, ids, x, h, out, eff, fetched=True)
        rig.poison(h, out)
        stage.upload(np.full(stage.shape, 0xA5, np.uint8))
        rig.run(fetch, gu, dn)
        want_eff, copies = kmoe.fetch_table(table, ids_v, lo, hi, lay, stage.ptr)
        assert (eff.download() == want_eff).all()
        assert len(copies) == 6                              # experts 1 and 5, three parts each
        staged, hb = stage.download(), host.array(np.uint8, (host.nbytes,))
        for e_src, d, n in copies:
            assert (staged[d:d + n] == hb[e_src - host.dptr:e_src - host.dptr + n]).all()
        assert (out.download() == got).all(), "fetched experts differ from the ones read over PCIe"
        # predicted ids fetched first (the previous layer's prefetch), then this layer's fetch: with the route's
        # width, expert 5 from the prefetch's staging and only expert 1 copied again; with a prediction wider
        # than the route (prefetch_extra 1), both misses among its five and nothing copied again
        for p_v, p_ids, p_eff, again in ((pre_v, pre_ids, pre_eff, [1]), (wide_v, wide_ids, wide_eff, [])):
            prefetch = kmoe.fetch_launch(rig.k.fn("moe", "moe_fetch"), "prefetch", cfg, ptab, p_ids, p_eff,
                                         pre_stage, lay, lo, hi, 16, k=len(p_v))
            fetch = kmoe.fetch_launch(rig.k.fn("moe", "moe_fetch"), "fetch", cfg, ptab, ids, eff, stage, lay, lo, hi,
                                      2 * rig.dev.n_sm, pre=(p_ids, p_eff))
            rig.poison(h, out)
            for b in (stage, pre_stage):
                b.upload(np.full(b.shape, 0xA5, np.uint8))
            rig.run(prefetch, fetch, gu, dn)
            want_pre, pre_copies = kmoe.fetch_table(table, p_v, lo, hi, lay, pre_stage.ptr)
            assert (p_eff.download() == want_pre).all()
            assert len(pre_copies) == 3 * len({1, 5} & set(p_v.tolist()))          # the misses it predicted
            want_eff, copies = kmoe.fetch_table(table, ids_v, lo, hi, lay, stage.ptr, p_v, want_pre)
            assert (eff.download() == want_eff).all() and len(copies) == 3 * len(again)
            for j, e in enumerate(ids_v.tolist()):                   # a predicted miss takes the prefetch's parts
                if e in (1, 5) and e not in again:
                    assert (want_eff[j] == want_pre[p_v.tolist().index(e)]).all()
            if not again:
                assert (stage.download() == 0xA5).all(), "the fetch copied an expert the prefetch had"
            for buf, cps in ((pre_stage, pre_copies), (stage, copies)):
                staged = buf.download()
                for e_src, d, n in cps:
                    assert (staged[d:d + n] == hb[e_src - host.dptr:e_src - host.dptr + n]).all()
            assert (out.download() == got).all(), f"prefetched experts ({len(p_v)} predicted) differ from PCIe's"
    finally:
        host.free()


def variant_kernels(rig, monkeypatch, module: str, define: str = "GEMM_XPREP", value: int = 1):
    """fn_of(kernel name) of `module` built with `define`=value (GEMM_XPREP: the tiles' copy of prepared rows;
    GEMM_WPREP: of prepared weights), and gemm.py's twin of the define takes the value (the launches' shared
    memory): the emulator builds the variant for the test, and so does NVRTC on the GPU when the session's build
    differs."""
    from strata.kernels import gemm as kgemm
    from strata.kernels.build import Module
    name = define.removeprefix("GEMM_")
    if getattr(kgemm, name) == value and not isinstance(rig, EmuRig):
        return lambda n: rig.k.fn(module, n)
    monkeypatch.setenv("STRATA_KERNEL_DEFINES", os.environ.get("STRATA_KERNEL_DEFINES", "") + f" {define}={value}")
    monkeypatch.setattr(kgemm, name, value)
    if isinstance(rig, EmuRig):
        kx = EmuKernels(rig.k.cache)
        return lambda n: kx.fn(module, n)
    mod = Module(module, rig.dev.arch)
    return mod.function


def check_tiles(plan, tiles: np.ndarray, counts: np.ndarray, pair_of: np.ndarray, ids: np.ndarray,
                slot: np.ndarray, k: int) -> None:
    """moe_group's tile table against moe.py's rule (TilePlan): per list, each tile's slot, first pair, pairs and
    plane row; each GPU expert's pairs [first, first + c) covered by its tiles in order, each pair's expert's."""
    rows, n_exp = ids.shape[0], len(slot)
    per = np.bincount(ids.ravel()[slot[ids.ravel()] >= 0], minlength=n_exp)
    want = plan.tile_counts(per)
    assert counts.tolist() == want, f"tile counts {counts.tolist()}, the rule's {want}"
    lists = [tiles[:4 * plan.cap].reshape(-1, 4)[:want[0]], tiles[4 * plan.cap:].reshape(-1, 4)[:want[1]]]
    assert all((t[:, 3] == base + np.arange(len(t)) * bn).all()
               for t, base, bn in zip(lists, (0, plan.cap * plan.bn), (plan.bn, plan.bn2))), "plane rows"
    assert (lists[0][:, 2] > plan.bn2).all() and (lists[0][:, 2] <= plan.bn).all()
    assert (lists[1][:, 2] <= plan.bn2).all()
    covered = np.full(rows * k, -1)
    for t in np.concatenate(lists):
        assert (covered[t[1]:t[1] + t[2]] == -1).all(), "a pair in two tiles"
        covered[t[1]:t[1] + t[2]] = t[0]
    flat = ids.ravel()
    gpu = slot[flat] >= 0
    assert (covered[pair_of[gpu]] == slot[flat[gpu]]).all(), "a pair in another expert's tile"
    assert (covered[len(pair_of[gpu]):] == -1).all()


@both_rigs
@pytest.mark.parametrize("qt,rows,prep", [
    (QType.Q2_0, 40, False), (QType.Q6_K, 40, False), (QType.Q4_K, 9, False), (QType.Q2_0, 40, True),
    (QType.Q6_K, 9, True), (QType.Q2_0, 100, True), (QType.Q6_K, 100, False), (QType.Q2_0, 9, True)],
    ids=["Q2_0-40", "Q6_K-40", "Q4_K-9", "Q2_0-40-prep", "Q6_K-9-prep", "Q2_0-100-prep", "Q6_K-100", "Q2_0-9-prep"])
def test_grouped_experts(rig, qt, rows, prep, monkeypatch):
    """The batched step's routed experts: moe_group lays the step's (row, choice) pairs out expert by expert in tiles
    (128 pairs at 100 rows, an expert's last <= 64 in a second list of 64-pair tiles; 64 at 40, 16 at 9), the
    grouped GLU and down GEMMs (gemm.cuh's tile) compute each pair at its expert's slot; a pair whose expert has no
    VRAM slot is left to the host (pair_of -1). Against float64; the tile table against moe.py's rule. prep: in a
    GEMM_XPREP build, each GEMM's tile rows split once by moe_split: bit for bit the tiles' own split. At 100 rows
    the 128-pair tiles alone (MOE_NARROW_LAST=0) give the same numbers bit for bit."""
    rng = np.random.default_rng(int(qt) + rows)
    E, Fn, n_exp, k = 256, 256, 6, 4
    cfg = cfg_tiny(n_embd=E, n_ff_exp=Fn, n_expert=n_exp, n_expert_used=k)
    sc = lambda n: 1 / (64 * np.sqrt(n))
    g_raw, u_raw, d_raw = (random_matrix(qt, n_exp * Fn, E, rng, sc(E)), random_matrix(qt, n_exp * Fn, E, rng, sc(E)),
                           random_matrix(qt, n_exp * E, Fn, rng, sc(Fn)))
    G, U, Dn = (dequantize(g_raw, qt).reshape(n_exp, Fn, E).astype(np.float64),
                dequantize(u_raw, qt).reshape(n_exp, Fn, E).astype(np.float64),
                dequantize(d_raw, qt).reshape(n_exp, E, Fn).astype(np.float64))
    gm, um, dm = (rig.mat("gate", g_raw, qt, Fn, E, n_exp), rig.mat("up", u_raw, qt, Fn, E, n_exp),
                  rig.mat("down", d_raw, qt, E, Fn, n_exp))
    bank = kmoe.ExpertBank(gm, 0, um, 0, dm, 0, (gm.mat_bytes, um.mat_bytes, dm.mat_bytes))
    slot_v = np.array([2, 0, -1, 5, 1, 3], np.int32)          # expert 2 on the host
    ids_v = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(rows)]).astype(np.int32)
    X = rng.standard_normal((rows, E)).astype(F32)
    plan = kmoe.tile_plan(rows, k, n_exp)
    assert (plan.bn, plan.bn2) == {9: (16, 0), 40: (64, 0), 100: (128, 64)}[rows]    # 128: gemm.cuh's paired GLU
    plans = [plan] + ([kmoe.TilePlan(128, min(n_exp, rows * k) + rows * k // 128)] if rows == 100 else [])
    ids, slot_of = rig.buf("ids", (rows, k), np.int32, ids_v), rig.buf("slot_of", (n_exp,), np.int32, slot_v)
    step = rig.buf("step", (STEP_N,), np.int32, step_words())
    pair_tok, pair_of = rig.buf("pair_tok", (rows * k,), np.int32), rig.buf("pair_of", (rows * k,), np.int32)
    tiles = rig.buf("tiles", (4 * max(p.cap + p.cap2 for p in plans),), np.int32)
    n_tiles = rig.buf("n_tiles", (2,), np.int32)
    job, x = rig.buf("job", (kmoe.MOE_JOB_DTYPE.itemsize,), np.uint8), rig.buf("x", (rows, E), value=X)
    h, out = rig.buf("h", (rows * k, kmoe.padded_ff(cfg))), rig.buf("out", (rows * k, E))
    if prep:
        from strata.kernels import gemm as kgemm
        sp_plan = kmoe.split_plan(cfg, bank, plan)
        bk = 64 if qt == QType.Q2_0 else 128           # Q6_K's 256-element blocks: k-chunks of 128
        assert sp_plan == ((E, bk, plan.plane_rows), (Fn, bk, plan.plane_rows))
        splits = [kgemm.XSplit(rig.buf(f"xs{i}", (kgemm.xsplit_bytes(*p),), np.uint8), *p)
                  for i, p in enumerate(sp_plan)]
    rig.commit()
    w = step_words()
    w[3] = rows                                                # STEP_T: the step's rows
    step.upload(w)
    fn_of = variant_kernels(rig, monkeypatch, "moe") if prep else lambda n: rig.k.fn("moe", n)

    def run(pl, splits=None):
        """(pair_of, pair_tok, out) of one grouping and its launches, the tile table checked"""
        grp = kmoe.group_launch(rig.k.fn("moe", "moe_group"), "group", cfg, ids, slot_of, step, pair_tok, pair_of,
                                tiles, n_tiles, rows, pl)
        launches = kmoe.grouped_launches(fn_of, "experts", cfg, job, bank, tiles, n_tiles, x, pair_tok, h, out,
                                         rows, pl, splits, rig.dev.arch)
        rig.poison(h, out)
        rig.run(grp, *launches)
        check_tiles(pl, tiles.download(), n_tiles.download(), pair_of.download(), ids_v, slot_v, k)
        return pair_of.download(), pair_tok.download(), out.download(), [ln.name for ln in launches]

    # each GPU (row, choice)'s output, wherever its pair landed: a pair's place inside its expert's group is the
    # order of moe_group's atomics, which differs between runs on the GPU
    by_choice = lambda r: r[2][r[0][r[0] >= 0]]
    first = run(plan)
    po, pt, got, _ = first
    live = po[po >= 0]
    for pl in plans[1:]:
        assert np.array_equal(by_choice(run(pl)), by_choice(first)), "128-pair tiles alone gave other numbers"
    if prep:
        for xs in splits:
            xs.buf.upload(np.full(xs.buf.shape, 0xA5, np.uint8))          # stale planes would show
        prepared = run(plan, splits)
        names = ["experts.gate_up_split", "experts.gate_up", "experts.down_split", "experts.down"]
        if plan.bn2:
            names = ["experts.gate_up_split", "experts.gate_up_split.64", "experts.gate_up", "experts.gate_up.64",
                     "experts.down_split", "experts.down_split.64", "experts.down", "experts.down.64"]
        assert prepared[3] == names
        assert np.array_equal(by_choice(prepared), by_choice(first)), "the prepared rows give other numbers"
    assert np.array_equal(np.sort(live), np.arange(len(live))), "pairs are not a permutation"
    for t in range(rows):
        for j in range(k):
            e, p = ids_v[t, j], po[t * k + j]
            if slot_v[e] < 0:
                assert p == -1
                continue
            assert pt[p] == t
            s = slot_v[e]
            ref = expert_ffn(G[s], U[s], Dn[s], X[t].astype(np.float64))
            assert rel(got[p], ref) <= TOL, f"row {t} expert {e}: {rel(got[p], ref):.2e}"
    assert np.isnan(got[len(live):]).all(), "a pair past the step's was written"


@both_rigs
def test_combine_write_rms(rig):
    rng = np.random.default_rng(8)
    cfg = cfg_tiny(n_embd=300, n_expert_used=5, hc=3)
    k, E, hc = 5, 300, 3
    wv, gp, hp = rng.dirichlet(np.ones(k)).astype(F32), rng.standard_normal((k, E)).astype(F32), \
        rng.standard_normal((k, E)).astype(F32)
    slots_v = np.array([2, -1, 0, -1, 9], np.int32)
    sh, sg = rng.standard_normal(E).astype(F32), rng.standard_normal(1).astype(F32)
    inj, Rv = rng.standard_normal(hc).astype(F32), rng.standard_normal((hc, E)).astype(F32)
    nv = (1 + 0.2 * rng.standard_normal((hc, E))).astype(F32)
    bufs = [rig.buf(n, v.shape, v.dtype, v) for n, v in (("w", wv), ("slots", slots_v), ("gp", gp), ("hp", hp),
                                                         ("sh", sh), ("sg", sg), ("inj", inj))]
    R, comb, nb, xn = rig.buf("R", (hc, E), value=Rv), rig.buf("comb", (E,)), rig.buf("n", (hc, E), value=nv), \
        rig.buf("xn", (hc, E))
    rig.commit()
    rig.poison(comb, xn)
    rig.run(kmoe.combine_launch(rig.k.fn("moe", "combine_write_rms"), "combine", cfg, *bufs, R, comb, nb, xn))
    parts = np.where(slots_v[:, None] >= 0, gp, hp)
    out = combine(wv[None], parts[None], (sh * (1 / (1 + np.exp(-sg[0]))).astype(F32))[None])[0]
    Rn = gr_write(Rv[None], (2 / (1 + np.exp(-inj / hc))).astype(F32)[None], out[None])[0]
    assert rel(comb.download(), out) <= TOL
    assert rel(R.download(), Rn) <= TOL
    assert rel(xn.download(), rms_norm(Rn, nv, 1e-6)) <= TOL


@both_rigs
@pytest.mark.parametrize("hc", [4, 2])
def test_combine_rows(rig, hc):
    """The batched step's combine, gr_write and next norm (one CTA a row, every stream) over 6 rows, parts from the
    GPU's pair outputs or the host's, against numpy; each row bit for bit what combine_write_rms gives that row."""
    rng = np.random.default_rng(hc)
    rows, k, E = 6, 5, 300
    cfg = cfg_tiny(n_embd=E, n_expert_used=k, hc=hc)
    wv = rng.dirichlet(np.ones(k), rows).astype(F32)
    pair_v = rng.permutation(rows * k).astype(np.int32)
    pair_v[rng.random(rows * k) < 0.3] = -1                               # those rows' parts from the host
    gp, hp = rng.standard_normal((rows * k, E)).astype(F32), rng.standard_normal((rows * k, E)).astype(F32)
    sh, sg = rng.standard_normal((rows, E)).astype(F32), rng.standard_normal(rows).astype(F32)
    inj, Rv = rng.standard_normal((rows, hc)).astype(F32), rng.standard_normal((rows, hc, E)).astype(F32)
    nv = (1 + 0.2 * rng.standard_normal((hc, E))).astype(F32)
    bufs = [rig.buf(n, v.shape, v.dtype, v) for n, v in (("w", wv), ("pair", pair_v), ("gp", gp), ("hp", hp),
                                                         ("sh", sh), ("sg", sg), ("inj", inj))]
    R, comb, nb, xn = (rig.buf("R", (rows, hc, E), value=Rv), rig.buf("comb", (rows, E)),
                       rig.buf("n", (hc, E), value=nv), rig.buf("xn", (rows, hc, E)))
    # one row at a time through the one-row kernel, on copies of that row's inputs
    R1, comb1, xn1 = rig.buf("R1", (hc, E)), rig.buf("comb1", (E,)), rig.buf("xn1", (hc, E))
    one = [rig.buf(n, shape, dt) for n, shape, dt in (("w1", (k,), F32), ("slots1", (k,), np.int32),
                                                       ("gp1", (k, E), F32), ("hp1", (k, E), F32), ("sh1", (E,), F32),
                                                       ("sg1", (1,), F32), ("inj1", (hc,), F32))]
    step = rig.buf("step", (STEP_N,), np.int32, step_words(rows=rows))
    rig.commit()
    rig.poison(comb, xn)
    rig.run(kmoe.combine_rows_launch(rig.k.fn("moe", "combine_rows"), "combine", cfg, *bufs, R, comb, nb, xn, step,
                                     rows))
    got_R, got_comb, got_xn = R.download(), comb.download(), xn.download()
    parts = np.where(pair_v.reshape(rows, k, 1) >= 0, gp[np.maximum(pair_v, 0)].reshape(rows, k, E),
                     hp.reshape(rows, k, E))
    out = combine(wv, parts, (sh * (1 / (1 + np.exp(-sg)))[:, None]).astype(F32))
    Rn = gr_write(Rv, (2 / (1 + np.exp(-inj / hc))).astype(F32), out)
    assert rel(got_comb, out) <= TOL and rel(got_R, Rn) <= TOL
    assert rel(got_xn, rms_norm(Rn, nv, 1e-6)) <= TOL
    for t in range(rows):
        slots = np.where(pair_v[t * k:(t + 1) * k] >= 0, 0, -1).astype(np.int32)
        for b, v in zip(one, (wv[t], slots, parts[t], parts[t], sh[t], sg[t:t + 1], inj[t])):
            b.upload(v)
        R1.upload(Rv[t])
        rig.run(kmoe.combine_launch(rig.k.fn("moe", "combine_write_rms"), "combine1", cfg, *one, R1, comb1, nb, xn1))
        assert (comb1.download() == got_comb[t]).all() and (R1.download() == got_R[t]).all()
        assert (xn1.download() == got_xn[t]).all(), f"row {t}"


# ---- PLE ---------------------------------------------------------------------------------------------------

@both_rigs
def test_ple_block(rig):
    """The PLE block (ple_gate, ple_conv, ple_hist) over 12 tokens fed one row a step, then in steps of 5, 1 and 6
    rows, then all 12 at once (the 9-row history wraps; a step's taps read both its own rows and the history)
    against ple_block with key/value projections from numpy, every row; the steps of several rows bit for bit the
    rows one at a time."""
    rng = np.random.default_rng(9)
    hc, E, n = 3, 130, 12
    cfg = cfg_tiny(n_embd=E, hc=hc, ple_layers=(1,), ple_ngram=3, ple_heads_per_ngram=2, ple_conv=4, ple_eos=5,
                   ple_row=20, ple_multipliers=(1, 2, 3), ple_offsets=(0, 10, 20, 30), ple_vocab_sizes=(10,) * 4)
    C, P = cfg.hc_dim, cfg.ple_dim
    nrm = lambda: (1 + 0.2 * rng.standard_normal((hc, E))).astype(F32)
    w = SimpleNamespace(ple_key=(rng.standard_normal((C, P)) / np.sqrt(P)).astype(F32),
                        ple_value=(rng.standard_normal((E, P)) / np.sqrt(P)).astype(F32),
                        ple_norm_key=nrm(), ple_norm_query=nrm(), ple_norm_conv=nrm(),
                        ple_conv1d=(0.5 * rng.standard_normal((C, cfg.ple_conv))).astype(F32))
    es = rng.standard_normal((n, P)).astype(F32)
    Rs = rng.standard_normal((n, hc, E)).astype(F32)
    keys, values = es @ w.ple_key.T, es @ w.ple_value.T          # once: numpy's matmul rounds by its shapes
    R, key, value = rig.buf("R", (n, hc, E)), rig.buf("key", (n, C)), rig.buf("value", (n, E))
    gate = rig.buf("gate", (n, hc))
    norms = [rig.buf(m, (hc, E), value=getattr(w, m)) for m in ("ple_norm_key", "ple_norm_query", "ple_norm_conv")]
    cw, hist, step = (rig.buf("conv", (C, cfg.ple_conv), value=w.ple_conv1d), rig.buf("hist", (cfg.ple_hist, C)),
                      rig.buf("step", (STEP_N,), np.int32))
    rig.commit()
    launches = kple.ple_launches(lambda k: rig.k.fn("ple", k), "ple", cfg, R, key, value, gate, *norms, cw, hist,
                                 step, n)
    pad = lambda a, T: np.concatenate([a, np.zeros((n - T, *a.shape[1:]), F32)])

    def run(chunks) -> np.ndarray:
        hist.upload(np.zeros((cfg.ple_hist, C), F32))           # a fresh sequence
        st, got, t = PleState.start(cfg), [], 0
        for T in chunks:
            e, Rv = es[t:t + T], Rs[t:t + T]
            R.upload(pad(Rv, T))
            key.upload(pad(keys[t:t + T], T))
            value.upload(pad(values[t:t + T], T))
            step.upload(step_words(pos=t, rows=T))
            rig.run(*launches)
            ref = ple_block(cfg, as_rows(w, "ple_key", "ple_value"), [(st, 0, T)], Rv, e)
            out = R.download()[:T]
            for r in range(T):
                assert rel(out[r], ref[r]) <= TOL, f"steps {chunks}: t={t + r}"
            got.append(out)
            t += T
        return np.concatenate(got)
    one = run((1,) * n)
    for chunks in ((5, 1, 6), (n,)):
        assert np.array_equal(run(chunks), one), f"steps of {chunks} rows differ from one row a step"


# ---- GEMM (the batched step): every format against float64 and against the GEMV row by row ---------------

def on_rigs(cases, emu_too):
    """(rig, *case) parameters: each case on the GPU, and on the emulator where emu_too(case) holds."""
    out = []
    for c in cases:
        name = "-".join(getattr(v, "name", str(v)) for v in c)
        out.append(pytest.param("gpu", *c, marks=pytest.mark.gpu, id="gpu-" + name))
        if emu_too(c):
            out.append(pytest.param("emu", *c, id="emu-" + name))
    return out


# buckets of 3, 70 and 150 rows: BN = 16, the 128 x 64 tiles and the 64 x 128 ones (gemm.py shape_for); the emulator
# takes the 3-row buckets and the wide tile in one format per k-chunk (a 70-row bucket costs it 25 s a format)
GEMM_CASES = on_rigs([(QType(qt), t) for qt in sorted(kgemv.KERNEL_TYPES) for t in (3, 70, 150)],
                     lambda c: c[1] == 3 or (c[1] == 150 and c[0] in (QType.Q4_K, QType.Q6_K)))


@pytest.mark.parametrize("rig,qt,max_rows", GEMM_CASES, indirect=["rig"])
def test_gemm_formats(rig, qt, max_rows):
    """Y = X W^T over a bucket of max_rows rows with fewer live (n_rows is device data): rows past it untouched,
    every live row within 1e-5 of float64 and of the f32 GEMV of that row; 3xFP16 with per-row scaling is what
    makes that hold."""
    from strata.kernels import gemm as kgemm
    rng = np.random.default_rng(int(qt) * 11 + max_rows)
    qk = kgemv.BLOCKS[qt][0]
    n_in = 8 * 40 + 5 if qt in kgemv.FLOAT_TYPES else qk * max(3, 640 // qk)   # not a multiple of the k-chunk
    n_out, live = (101 if max_rows < 64 else 1100), max_rows - 1     # 1100: the wide tiles, a partial last
    raw = random_matrix(qt, n_out, n_in, rng)
    ldx = (n_in + 3) // 4 * 4
    X = np.zeros((max_rows, ldx), F32)
    X[:, :n_in] = rng.standard_normal((max_rows, n_in))
    m = rig.mat("w", raw, qt, n_out, n_in)
    xb = rig.buf("x", X.shape, value=X)
    y = rig.buf("y", (max_rows, n_out))
    nr = rig.buf("n_rows", (1,), np.int32, [live])
    picks = (0, live - 1)
    gv = [(rig.buf(f"gv_x{t}", (n_in,), value=X[t, :n_in]), rig.buf(f"gv_y{t}", (n_out,))) for t in picks]
    table = kgemm.job_table("jobs", 1, rig.A.reserve)
    gv_table = kgemv.job_table("gv", len(picks), rig.A.reserve)
    rig.commit()
    jobs = [kgemm.GemmJob(m, xb, y, ldx=ldx)]
    assert kgemm.gemm_plan(jobs, max_rows)[3].startswith("gemm_jobs128") == (max_rows == 150 and kgemm.WIDE_N == 1)
    launch = kgemm.gemm_launch(lambda n: rig.k.fn("gemm", n), "gemm", table, jobs, nr, max_rows, arch=rig.dev.arch)
    gemv = kgemv.gemv_launch(rig.k.fn("gemv", "gemv_jobs"), "gemv", gv_table, [Job(m, a, b) for a, b in gv])
    rig.poison(y)
    rig.run(launch, gemv)
    out = y.download()
    W = dequantize(raw, qt).reshape(n_out, n_in).astype(np.float64)
    ref = X[:, :n_in].astype(np.float64) @ W.T
    assert np.isnan(out[live:]).all(), "a row past n_rows was written"
    for t in range(live):
        assert rel(out[t], ref[t]) <= TOL, f"row {t}: {rel(out[t], ref[t]):.2e}"
    for t, (_, b) in zip(picks, gv):              # the T=1 path (GEMV) of the same row
        assert rel(out[t], b.download()) <= TOL, f"row {t} vs GEMV: {rel(out[t], b.download()):.2e}"


@pytest.mark.parametrize("qt", [QType.F32, QType.Q8_0], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("rig, n_in, n_out, kernel",       # the emulator takes the short rows (the long: 20-120 s)
                         on_rigs([(512, 70, "gemm_jobs64_k64_m64"), (10240, 70, "gemm_jobs64_k64_m64"),
                                  (6144, 1100, "gemm_jobs64_k64")], lambda c: c[0] == 512), indirect=["rig"])
def test_gemm_dynamic_range(rig, qt, n_in, n_out, kernel):
    """f16 halves hold about 5 decades, so the tile scales each row's k-chunk by a power of two: weight rows from
    1e-7 to 1e3, step rows from 1e-9 to 1e4, a row whose magnitude jumps 1e6 between k-chunks, one with zero
    chunks between live ones; every row within 1e-5 of float64 and of the GEMV. Inputs as long as the hc reads'
    (10240: 160 k-chunks, where a tensor-core accumulator's truncation would add up), in both tile heights."""
    from strata.kernels import gemm as kgemm
    rng = np.random.default_rng(31)
    T = 24
    assert kgemm.kernel_name(T, 64, False, n_out) == kernel
    W = rng.standard_normal((n_out, n_in)) * 10.0 ** rng.uniform(-7, 3, (n_out, 1))
    if qt == QType.F32:
        raw, Wd = W.astype(F32).view(np.uint8), W.astype(F32).astype(np.float64)
    else:
        from strata.quant.quantize import quantize
        raw = quantize(W.astype(F32), qt).reshape(n_out, -1)
        Wd = dequantize(raw, qt).reshape(n_out, n_in).astype(np.float64)
    X = rng.standard_normal((T, n_in)) * 10.0 ** rng.uniform(-9, 4, (T, 1))
    X[0, 256:] *= 1e6                                 # later chunks a million times the first ones
    X[1, :320] *= 1e-6
    X[2, 64:192] = 0.0                                # zero chunks between live ones
    X = X.astype(F32)
    m = rig.mat("w", raw, qt, n_out, n_in)
    xb = rig.buf("x", X.shape, value=X)
    y = rig.buf("y", (T, n_out))
    nr = rig.buf("n_rows", (1,), np.int32, [T])
    gv = [(rig.buf(f"gv_x{t}", (n_in,), value=X[t]), rig.buf(f"gv_y{t}", (n_out,))) for t in range(3)]
    table = kgemm.job_table("jobs", 1, rig.A.reserve)
    gv_table = kgemv.job_table("gv", len(gv), rig.A.reserve)
    rig.commit()
    launch = kgemm.gemm_launch(lambda n: rig.k.fn("gemm", n), "gemm", table, [kgemm.GemmJob(m, xb, y)], nr, T)
    gemv = kgemv.gemv_launch(rig.k.fn("gemv", "gemv_jobs"), "gemv", gv_table, [Job(m, a, b) for a, b in gv])
    rig.poison(y)
    rig.run(launch, gemv)
    out = y.download()
    ref = X.astype(np.float64) @ Wd.T
    for t in range(T):
        assert rel(out[t], ref[t]) <= TOL, f"row {t}: {rel(out[t], ref[t]):.2e}"
    for t, (_, b) in enumerate(gv):
        assert rel(out[t], b.download()) <= TOL, f"row {t} vs GEMV: {rel(out[t], b.download()):.2e}"
    # per weight row too: the small rows must not drown in the large ones' error
    for i in range(n_out):
        assert rel(out[:, i], ref[:, i]) <= TOL, f"weight row {i}: {rel(out[:, i], ref[:, i]):.2e}"


@both_rigs
def test_gemm_one_table_two_buckets(rig):
    """The backend fills one job table per launch and captures it for every bucket of rows, whose tiles take 128
    weight rows (64 step rows, wide matrices) or 64 (16): two jobs through one table at 40 rows and at 9, against
    float64."""
    from strata.kernels import gemm as kgemm
    rng = np.random.default_rng(12)
    n_in, T = 512, 40
    X = rng.standard_normal((T, n_in)).astype(F32)
    xb = rig.buf("x", X.shape, value=X)
    nr = rig.buf("n_rows", (1,), np.int32, [T])
    na, nb = 1100, 1030                                   # partial last tiles of 128 rows (and of 64)
    ra, rb = random_matrix(QType.Q8_0, na, n_in, rng), random_matrix(QType.Q4_K, nb, n_in, rng)
    a, b = rig.mat("a", ra, QType.Q8_0, na, n_in), rig.mat("b", rb, QType.Q4_K, nb, n_in)
    ya, yb = rig.buf("ya", (T, na)), rig.buf("yb", (T, nb))
    table = kgemm.job_table("jobs", 2, rig.A.reserve)
    rig.commit()
    jobs = [kgemm.GemmJob(a, xb, ya), kgemm.GemmJob(b, xb, yb)]
    refs = [X.astype(np.float64) @ dequantize(r, q).reshape(n, n_in).astype(np.float64).T
            for r, q, n in ((ra, QType.Q8_0, na), (rb, QType.Q4_K, nb))]
    assert kgemm.kernel_name(T, 64, False, nb) == "gemm_jobs64_k64" and kgemm.tile_bm(64, False, nb) == 128
    launches = {t: kgemm.gemm_launch(lambda n: rig.k.fn("gemm", n), "gemm", table, jobs, nr, t) for t in (T, 9)}
    for t, launch in launches.items():
        nr.upload(np.array([t], np.int32))
        rig.poison(ya, yb)
        rig.run(launch)
        for y, ref in zip((ya, yb), refs):
            out = y.download()
            assert rel(out[:t], ref[:t]) <= TOL, f"{t} rows"
            assert np.isnan(out[t:]).all()


@both_rigs
def test_gemm_split_k(rig):
    """A split-K launch (gemm.py k_slices): two plain jobs like an hc read's down projection and inject (320 and 4
    outputs; Q8_0 and F32) over 992 inputs (a partial last k-chunk) in 5 slices of 4 chunks, the last slice empty,
    the slices added by gemm_ksum; every live row within 1e-5 of float64 and of the unsplit launch, rows past n_rows
    untouched, at a 24-row bucket with 23 live and at a 9-row one (BN = 16) through the same job table."""
    from strata.kernels import gemm as kgemm
    rng = np.random.default_rng(41)
    n_in, T, ks = 992, 24, 5
    X = (rng.standard_normal((T, n_in)) * 10.0 ** rng.uniform(-2, 2, (T, 1))).astype(F32)
    xb = rig.buf("x", X.shape, value=X)
    nr = rig.buf("n_rows", (1,), np.int32, [T - 1])
    rd, ri = random_matrix(QType.Q8_0, 320, n_in, rng), random_matrix(QType.F32, 4, n_in, rng)
    d, i = rig.mat("down", rd, QType.Q8_0, 320, n_in), rig.mat("inject", ri, QType.F32, 4, n_in)
    ys = [rig.buf(f"y{k}", (T, n)) for k, n in enumerate((320, 4, 320, 4))]
    part = rig.buf("part", (ks * T * 324,))
    tables = [kgemm.job_table(f"jobs{k}", 2, rig.A.reserve) for k in range(2)]
    rig.commit()
    refs = [X.astype(np.float64) @ dequantize(r, q).reshape(n, n_in).astype(np.float64).T
            for r, q, n in ((rd, QType.Q8_0, 320), (ri, QType.F32, 4))]
    plain = [kgemm.GemmJob(d, xb, ys[0]), kgemm.GemmJob(i, xb, ys[1])]
    split = [kgemm.GemmJob(d, xb, ys[2]), kgemm.GemmJob(i, xb, ys[3])]
    fn = lambda n: rig.k.fn("gemm", n)          # noqa: E731
    for t in (T, 9):
        live = t - 1
        nr.upload(np.array([live], np.int32))
        rig.poison(*ys, part)
        rig.run(kgemm.gemm_launch(fn, "plain", tables[0], plain, nr, t),
                kgemm.gemm_launch(fn, "split", tables[1], split, nr, t, ks=ks, part=part),
                kgemm.ksum_launch(fn("gemm_ksum"), "ksum", tables[1], split, nr, t, ks, part))
        for y0, y1, ref in ((ys[0], ys[2], refs[0]), (ys[1], ys[3], refs[1])):
            o0, o1 = y0.download(), y1.download()
            assert rel(o1[:live], ref[:live]) <= TOL, f"{t} rows: {rel(o1[:live], ref[:live]):.2e} of float64"
            assert rel(o1[:live], o0[:live]) <= TOL, f"{t} rows: {rel(o1[:live], o0[:live]):.2e} of unsplit"
            assert np.isnan(o1[live:]).all(), f"{t} rows: a row past n_rows was written"


@both_rigs
@pytest.mark.parametrize("types,n_in", [((QType.Q4_K, QType.Q8_0), 768), ((QType.Q6_K, QType.IQ4_XS), 768),
                                        ((QType.F32, QType.BF16), 549)], ids=["k64", "k128", "tail"])
def test_gemm_prepared_rows(rig, types, n_in, monkeypatch):
    """Step rows split once by x_split (gemm.py XSplit) for a launch of two jobs: the same numbers, bit for bit, as
    the tiles splitting x themselves, at a 150-row bucket (64 x 128 tiles) and a 40-row one (128 x 64) of the same
    split buffer (549: a partial last k-chunk, rows not a multiple of 4), rows past n_rows untouched; and within
    1e-5 of float64. The emulator builds gemm.cu with GEMM_XPREP=1 for it; on the GPU it runs in such a build."""
    from strata.kernels import gemm as kgemm
    fn = variant_kernels(rig, monkeypatch, "gemm")
    rng = np.random.default_rng(17 + n_in)
    T, (qa, qb), (na, nb) = 150, types, (1100, 1030)
    X = (rng.standard_normal((T, n_in)) * 10.0 ** rng.uniform(-3, 3, (T, 1))).astype(F32)
    xb = rig.buf("x", X.shape, value=X)
    nr = rig.buf("n_rows", (1,), np.int32, [T])
    ra, rb = random_matrix(qa, na, n_in, rng, 0.05), random_matrix(qb, nb, n_in, rng, 0.05)
    a, b = rig.mat("a", ra, qa, na, n_in), rig.mat("b", rb, qb, nb, n_in)
    bk = kgemm.chunk_k([qa, qb])
    split = kgemm.XSplit(rig.buf("xs", (kgemm.xsplit_bytes(n_in, bk, T),), np.uint8), n_in, bk, T)
    ys = [rig.buf(f"y{i}", (T, n)) for i, n in enumerate((na, nb, na, nb))]
    tables = [kgemm.job_table(f"jobs{i}", 2, rig.A.reserve) for i in range(2)]
    rig.commit()
    refs = [X.astype(np.float64) @ dequantize(r, q).reshape(n, n_in).astype(np.float64).T
            for r, q, n in ((ra, qa, na), (rb, qb, nb))]
    plain = [kgemm.GemmJob(a, xb, ys[0]), kgemm.GemmJob(b, xb, ys[1])]
    prep = [kgemm.GemmJob(a, xb, ys[2], xs=split), kgemm.GemmJob(b, xb, ys[3], xs=split)]
    for t in (T, 40):
        assert kgemm.gemm_plan(prep, t)[3].startswith("gemm_jobs128" if t == T else "gemm_jobs64_")
        live = t - 1
        nr.upload(np.array([live], np.int32))
        rig.poison(*ys)
        split.buf.upload(np.full(split.buf.shape, 0xA5, np.uint8))     # stale planes would show
        rig.run(kgemm.gemm_launch(fn, "plain", tables[0], plain, nr, t),
                kgemm.xsplit_launch(fn, "split", xb, n_in, split, nr, t),
                kgemm.gemm_launch(fn, "prep", tables[1], prep, nr, t))
        for y0, y1, ref in ((ys[0], ys[2], refs[0]), (ys[1], ys[3], refs[1])):
            o0, o1 = y0.download(), y1.download()
            assert np.array_equal(o0[:live], o1[:live]), f"{t} rows: the prepared rows give other numbers"
            assert rel(o1[:live], ref[:live]) <= TOL and np.isnan(o1[live:]).all()


@both_rigs
def test_gemm_prepared_weights(rig, monkeypatch):
    """Weights decoded and split once by w_split (gemm.py wsplit_launch): the same numbers, bit for bit, as the tiles
    decoding them, for two plain jobs (Q4_K, Q8_0: partial last tiles of 64 and 128 rows) at a 150-row bucket (64 x
    128 tiles) and a 40-row one (128 x 64) with the CTAs in groups of 3 M tiles, and a GLU pair whose gate is
    f16-exact and whose up is not (Q2_0, Q6_K: the tile then reads the exact matrix's lo halves too); planes
    poisoned before the split; within 1e-5 of float64, rows past n_rows untouched. The emulator builds gemm.cu with
    GEMM_WPREP=1 for it; on the GPU it runs in such a build."""
    from strata.kernels import gemm as kgemm
    fn = variant_kernels(rig, monkeypatch, "gemm", "GEMM_WPREP")
    rng = np.random.default_rng(23)
    n_in, T = 768, 150
    X = rng.standard_normal((T, n_in)).astype(F32)
    xb = rig.buf("x", X.shape, value=X)
    nr = rig.buf("n_rows", (1,), np.int32, [T])
    specs = [(QType.Q4_K, 1100), (QType.Q8_0, 1030), (QType.Q2_0, 200), (QType.Q6_K, 200)]
    raws = [random_matrix(q, n, n_in, rng, 0.05) for q, n in specs]
    mats = [rig.mat(f"w{i}", r, q, n, n_in) for i, (r, (q, n)) in enumerate(zip(raws, specs))]
    splits = []
    for i, (q, n) in enumerate(specs):
        bk = kgemm.chunk_k([q] if i < 2 else [QType.Q2_0, QType.Q6_K])
        splits.append(kgemm.XSplit(rig.buf(f"ws{i}", (kgemm.xsplit_bytes(n_in, bk, n),), np.uint8), n_in, bk, n))
    ys = [rig.buf(f"y{i}", (T, n)) for i, n in enumerate((1100, 1030, 1100, 1030, 200, 200))]
    tables = [kgemm.job_table(f"jobs{i}", 2, rig.A.reserve) for i in range(4)]
    rig.commit()
    W = [dequantize(r, q).reshape(n, n_in).astype(np.float64) for r, (q, n) in zip(raws, specs)]
    X64 = X.astype(np.float64)
    with np.errstate(over="ignore"):
        g = X64 @ W[2].T
        refs = [X64 @ W[0].T, X64 @ W[1].T, g / (1 + np.exp(-g)) * (X64 @ W[3].T)]
    plain = [kgemm.GemmJob(mats[0], xb, ys[0]), kgemm.GemmJob(mats[1], xb, ys[1])]
    prep = [kgemm.GemmJob(mats[0], xb, ys[2], ws=splits[0]), kgemm.GemmJob(mats[1], xb, ys[3], ws=splits[1])]
    glu = [kgemm.GemmJob(mats[2], xb, ys[4], w2=mats[3])]
    glu_prep = [kgemm.GemmJob(mats[2], xb, ys[5], w2=mats[3], ws=splits[2], ws2=splits[3])]
    for t in (T, 40):
        live = t - 1
        nr.upload(np.array([live], np.int32))
        rig.poison(*ys)
        for sp in splits:
            sp.buf.upload(np.full(sp.buf.shape, 0xA5, np.uint8))
        rig.run(*[kgemm.wsplit_launch(fn, f"split{i}", m, 0, sp) for i, (m, sp) in enumerate(zip(mats, splits))],
                kgemm.gemm_launch(fn, "plain", tables[0], plain, nr, t),
                kgemm.gemm_launch(fn, "prep", tables[1], prep, nr, t, swz=3),
                kgemm.gemm_launch(fn, "glu", tables[2], glu, nr, t),
                kgemm.gemm_launch(fn, "glu_prep", tables[3], glu_prep, nr, t, swz=3))
        for y0, y1, ref in ((ys[0], ys[2], refs[0]), (ys[1], ys[3], refs[1]), (ys[4], ys[5], refs[2])):
            o0, o1 = y0.download(), y1.download()
            assert np.array_equal(o0[:live], o1[:live]), f"{t} rows: the prepared weights give other numbers"
            assert rel(o1[:live], ref[:live]) <= TOL and np.isnan(o1[live:]).all()


def test_compact_weight_tiles():
    """gemm.py compact_tile / smem_bytes (gemm.cuh GEMM_COMPACT_W): on sm_90 a launch whose weights are all f16-exact
    takes the weight tiles' hi halves only; a launch with any other type, or an unknown or other arch, the full
    tiles. The kernels' side runs in every grouped-expert and GEMM test of exact types (the emulator fails a launch
    that writes past its shared memory)."""
    from strata.kernels import gemm as kgemm
    if not kgemm.COMPACT_W:
        pytest.skip("this build packs no weight tiles (GEMM_COMPACT_W=0 or GEMM_WGMMA=0)")
    assert kgemm.compact_tile(90, [QType.Q2_0, QType.Q2_0]) and kgemm.compact_tile(90, [QType.BF16])
    assert not kgemm.compact_tile(90, [QType.Q2_0, QType.Q6_K]) and not kgemm.compact_tile(0, [QType.Q2_0])
    assert not kgemm.compact_tile(89, [QType.F16])
    full, compact = kgemm.smem_bytes(64, 16, 64, True), kgemm.smem_bytes(64, 16, 64, True, True)
    assert full - compact == 2 * 64 * (68 * 4 - 128) and compact == 2 * 64 * 128 + 16 * 68 * 4 + (2 * 64 + 16) * 4


def bare_batch(A, xprep: bool, wprep: bool):
    """A BatchPath of 300 rows over arena A without a backend behind it (its planning helpers only): the buckets up
    to 300 rows, 16 logit rows, 132 multiprocessors."""
    from strata.cuda.batch import BatchPath
    bp = object.__new__(BatchPath)
    bp.be, bp.rows, bp.buckets, bp.logit_rows = SimpleNamespace(A=A, dev=SimpleNamespace(n_sm=132)), 300, \
        (16, 64, 256, 300), 16
    bp._xsplits, bp.xprep, bp.wprep, bp._wsplit_bytes, bp._ksplit_floats = {}, xprep, wprep, 0, 0
    return bp


def test_batch_prepares_each_x_once(monkeypatch):
    """GEMM_XPREP's plan (strata.cuda.batch): a step's plain GEMM ops get x_split preps, one per distinct x in an op,
    and ops reading the same x in the same k-chunk share one split buffer; GLU ops, gathered rows, the head's ops
    (their own row count) and ops of few outputs keep the tile's own split; a Q6_K op splits in chunks of 128, apart."""
    from strata.cuda.arena import Arena, DevMat, Section
    from strata.kernels import gemm as kgemm
    from strata.kernels.gemm import GemmJob
    A = Arena()
    bp = bare_batch(A, xprep=True, wprep=False)
    bp.act = Section("activations")
    mat = lambda name, qt, n_out, n_in: DevMat(A.reserve(name, (n_out * row_bytes(qt, n_in),), np.uint8), int(qt),
                                               n_out, n_in, row_bytes(qt, n_in))
    x, x2, y = A.reserve("x", (300, 512)), A.reserve("x2", (300, 512)), A.reserve("y", (300, 2048))
    q4, q8, q6 = mat("q4", QType.Q4_K, 1024, 512), mat("q8", QType.Q8_0, 2048, 512), mat("q6", QType.Q6_K, 1024, 512)
    ops = [bp._gemm("a", [GemmJob(q4, x, y), GemmJob(q8, x, y), GemmJob(q4, x2, y)]),
           bp._gemm("b", [GemmJob(q8, x, y)]),
           bp._gemm("c", [GemmJob(q6, x, y)]),
           bp._gemm("glu", [GemmJob(q4, x, y, w2=q4)]),
           bp._gemm("gather", [GemmJob(q4, x, y, xrow=A.reserve("rows", (300,), np.int32))]),
           bp._gemm("head", [GemmJob(q4, x, y)], n_rows=A.reserve("n", (1,), np.int32)),
           bp._gemm("narrow", [GemmJob(mat("q8n", QType.Q8_0, 320, 512), x, y)])]      # < XPREP_MIN_OUT outputs
    preps = [op[5] for op in ops]
    assert [len(p) for p in preps] == [2, 1, 1, 0, 0, 0, 0]
    assert preps[0][0][2] is preps[1][0][2] and preps[0][1][0] is x2 and preps[2][0][2].bk == 128
    assert preps[0][0][2].max_rows == 300 and preps[0][0][2].rows == 384
    assert all(j.xs is not None for j in ops[0][3]) and all(j.xs is None for op in ops[3:] for j in op[3])
    assert len(bp._xsplits) == 3
    # split-K (gemm.py k_slices): only where few tiles meet long inputs. 320 outputs over 10240 inputs (160 k-chunks):
    # 5 M tiles of 64 rows by 1, 1, 4 and 5 N tiles (BN 16, 64, 64, 64) against 3 CTAs on each of 132 multiprocessors,
    # at most 160 / 8 slices; 512 inputs (8 chunks), the GLU ops and the wide ops never
    long = [GemmJob(mat("q8l", QType.Q8_0, 320, 10240), A.reserve("xl", (300, 10240)), y)]
    assert [kgemm.k_slices(long, t, 132) for t in bp.buckets] == [20, 20, 19, 15]
    assert all(kgemm.k_slices(op[3], t, 132) == 1 for op in ops for t in bp.buckets)
    assert bp._ksplit_floats == 0
    bp._gemm("long", long)
    assert bp._ksplit_floats == 19 * 256 * 320
    # the expert GEMMs' tile splits: one buffer per input length, planned before the experts' types are known,
    # so large enough for either k-chunk (576 = 9 chunks of 64 or 5 of 128: the 128s need more)
    bp.be.cfg = cfg_tiny(n_embd=512, n_ff_exp=576, n_expert=13, n_expert_used=3)
    tp = kmoe.tile_plan(300, 3, 13)                  # 69 pairs an expert: 128-pair tiles and the 64-pair list
    assert (tp.bn, tp.bn2) == (128, 64) and tp.plane_rows == tp.cap * 128 + tp.cap2 * 64
    bp._plan_tile_splits(tp)
    nr = tp.plane_rows
    b1 = SimpleNamespace(gate=q4, up=q4, down=q4)                  # (split_plan reads the banks' types only)
    b2 = SimpleNamespace(gate=q4, up=q4, down=q6)
    s1, s2 = bp._tile_splits(b1, tp), bp._tile_splits(b2, tp)
    assert s1[0].buf is s2[0].buf and s1[1].buf is s2[1].buf and s1[0].buf is not s1[1].buf
    assert [(x.n_in, x.bk, x.max_rows) for x in s1 + s2] == [(512, 64, nr), (576, 64, nr), (512, 64, nr),
                                                             (576, 128, nr)]
    assert s2[1].buf.size >= kgemm.xsplit_bytes(576, 128, nr) > kgemm.xsplit_bytes(576, 64, nr)
    bp.xprep = False
    bp._plan_tile_splits(tp)
    assert bp._tile_splits(b1, tp) is None


def test_batch_plans_weight_planes():
    """GEMM_WPREP's plan (strata.cuda.batch): every GEMM op but the head's (its own row count) gets places for its
    matrices' planes (a GLU partner's too) in one scratch sized for the largest op, and the buckets of many rows a
    second job table whose jobs read them; the places of an op do not overlap and fit the scratch."""
    from strata.cuda.arena import Arena, DevMat
    from strata.kernels import gemm as kgemm
    from strata.kernels.gemm import GemmJob
    A = Arena()
    bp = bare_batch(A, xprep=False, wprep=True)
    mat = lambda name, qt, n_out, n_in: DevMat(A.reserve(name, (n_out * row_bytes(qt, n_in),), np.uint8), int(qt),
                                               n_out, n_in, row_bytes(qt, n_in))
    x, y = A.reserve("x", (300, 512)), A.reserve("y", (300, 2048))
    q4, q8, q6 = mat("q4", QType.Q4_K, 1024, 512), mat("q8", QType.Q8_0, 2048, 512), mat("q6", QType.Q6_K, 1024, 512)
    ops = [bp._gemm("a", [GemmJob(q4, x, y), GemmJob(q8, x, y)]),
           bp._gemm("glu", [GemmJob(q4, x, y, w2=q6)]),
           bp._gemm("head", [GemmJob(q4, x, y)], n_rows=A.reserve("n", (1,), np.int32))]
    assert ops[2][6] is None and all(op[6] is not None for op in ops[:2])
    size = lambda w, bk: -(-kgemm.xsplit_bytes(w.n_in, bk, w.n_out) // 256) * 256
    assert ops[0][6][1] == 64 and ops[1][6][1] == 128                    # a Q6_K partner: chunks of 128
    assert ops[0][6][2] == [[0, None], [size(q4, 64), None]]
    assert ops[1][6][2] == [[0, size(q4, 128)]]
    assert bp._wsplit_bytes == max(size(q4, 64) + size(q8, 64), 2 * size(q4, 128))
    bp.wsplit_buf = A.reserve("b.wsplit", (bp._wsplit_bytes,), np.uint8)
    A.base = 1 << 20                                                     # views' addresses without a device
    jobs, fills = bp._wsplits("a", ops[0][3], ops[0][6])
    spans = sorted((j.ws.buf.ptr, j.ws.buf.ptr + j.ws.buf.nbytes) for j in jobs)
    assert spans[0][1] <= spans[1][0] and spans[1][1] <= bp.wsplit_buf.ptr + bp.wsplit_buf.nbytes
    assert [(j.ws.n_in, j.ws.bk, j.ws.max_rows, j.ws2) for j in jobs] == [(512, 64, 1024, None), (512, 64, 2048, None)]
    assert [f[0] for f in fills] == [q4, q8]
    jobs, fills = bp._wsplits("glu", ops[1][3], ops[1][6])
    assert jobs[0].ws2 is not None and jobs[0].ws2.buf.ptr == jobs[0].ws.buf.ptr + size(q4, 128) and len(fills) == 2


@both_rigs
@pytest.mark.parametrize("gt, ut", [(QType.Q4_K, QType.Q6_K), (QType.Q2_0, QType.Q6_K), (QType.Q2_0, QType.Q8_0),
                                    (QType.Q2_0, QType.BF16)],
                         ids=["Q4_K-Q6_K", "Q2_0-Q6_K", "Q2_0-Q8_0", "Q2_0-BF16"])
def test_gemm_glu_gather_and_jobs(rig, gt, ut):
    """One launch: a GLU pair over gathered rows, and a BF16 job; against float64. The pairs: neither type exact
    in f16, one (the tile then uses both weights' lo halves: Q2_0 in 128-element chunks, and in 64-element ones,
    where its tile holds the block's codes and zero lo halves, gemm.cuh deq_tile_q2c), both (two MMAs a product, no
    lo halves)."""
    from strata.kernels import gemm as kgemm
    rng = np.random.default_rng(9)
    n_in, T = 512, 40
    X = rng.standard_normal((T, n_in)).astype(F32)
    perm = rng.permutation(T).astype(np.int32)
    xb = rig.buf("x", X.shape, value=X)
    ib = rig.buf("idx", (T,), np.int32, perm)
    nr = rig.buf("n_rows", (1,), np.int32, [T])
    rg, ru, rbf = (random_matrix(gt, 70, n_in, rng), random_matrix(ut, 70, n_in, rng),
                   random_matrix(QType.BF16, 33, n_in, rng, 0.05))
    g, u, bf = (rig.mat("g", rg, gt, 70, n_in), rig.mat("u", ru, ut, 70, n_in),
                rig.mat("bf", rbf, QType.BF16, 33, n_in))
    y1, y2 = rig.buf("y1", (T, 70)), rig.buf("y2", (T, 40))
    table = kgemm.job_table("jobs", 2, rig.A.reserve)
    rig.commit()
    launch = kgemm.gemm_launch(lambda n: rig.k.fn("gemm", n), "gemm", table,
                               [kgemm.GemmJob(g, xb, y1, w2=u, xrow=ib), kgemm.GemmJob(bf, xb, y2, ldy=40)], nr, T)
    rig.poison(y1, y2)
    rig.run(launch)
    deq = lambda r, q, n: dequantize(r, q).reshape(n, n_in).astype(np.float64)
    a, b = X[perm].astype(np.float64) @ deq(rg, gt, 70).T, X[perm].astype(np.float64) @ deq(ru, ut, 70).T
    with np.errstate(over="ignore"):
        ref1 = a / (1 + np.exp(-a)) * b
    ref2 = X.astype(np.float64) @ deq(rbf, QType.BF16, 33).T
    assert rel(y1.download(), ref1) <= TOL
    out2 = y2.download()
    assert rel(out2[:, :33], ref2) <= TOL and np.isnan(out2[:, 33:]).all()
