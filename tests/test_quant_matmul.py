"""Batched kernels: every output row of matmul is bit for bit matvec on that row (all weight types, both modes, one
thread or two), F32 rows do not depend on T, and expert_batch_rows gives each (token, expert) pair what
expert_batch_at gives that token alone.

Each (type, mode) costs numba ~3 s to compile on a cold cache, hence the small shapes and few exact cases.
"""

from __future__ import annotations

import numpy as np
import pytest

import strata.quant.experts as qe
import strata.quant.matmul as mm
from strata.quant import QType, block_size, matvec, random_blocks
from strata.quant.experts import expert_batch_at, expert_batch_rows
from strata.quant.matmul import matmul
from strata.quant.matvec import _KERNELS

ROWS = 67                                          # the last row block is a partial one
TS = (1, 3, 17)
CONTRACT = list(_KERNELS) + [QType.F16, QType.BF16]
EXACT = [QType.Q2_0, QType.Q4_K, QType.Q8_0, QType.IQ4_XS, QType.F16]


def n_for(qt: QType) -> int:
    return {1: 300, 32: 288, 64: 832, 256: 512}[block_size(qt)]    # Q2_0: 13 blocks, quads and a lone tail


def inputs(qt: QType, t: int, seed: int = 0):
    rng = np.random.default_rng(seed + int(qt))
    n = n_for(qt)
    w = random_blocks(qt, (ROWS, n), rng, 0.05)                     # uint8 (ROWS, row_bytes)
    x = rng.standard_normal((t, n)).astype(np.float32)
    x[:, : n // 8] *= 4.0                                           # uneven block maxima
    return w, x


def threaded(w, qt, x, exact, monkeypatch):
    """matmul on two threads, whatever the size (the small-work cut-off off)."""
    with monkeypatch.context() as m:
        m.setattr(mm, "SERIAL_BYTES", 0)
        return matmul(w, qt, x, exact, n_threads=2)


@pytest.mark.parametrize("qt,exact", [(t, False) for t in CONTRACT] + [(t, True) for t in EXACT],
                         ids=lambda v: v.name if isinstance(v, QType) else ("exact" if v else "contract"))
def test_rows_equal_matvec(qt, exact, monkeypatch):
    for t in TS:
        w, x = inputs(qt, t)
        want = np.stack([matvec(w, qt, x[i], exact) for i in range(t)])
        out = np.full((t, ROWS), np.nan, np.float32)                # every element must be written
        assert matmul(w, qt, x, exact, out=out) is out
        assert np.array_equal(out, want), f"{qt.name} T={t}"
        assert np.array_equal(threaded(w, qt, x, exact, monkeypatch), want), f"{qt.name} T={t} 2 threads"


@pytest.mark.parametrize("exact", [False, True], ids=["contract", "exact"])
def test_f32_rows_do_not_depend_on_t(exact, monkeypatch):
    """F32 runs mv_f32 row by row (as Mat holds it: a float32 (rows, n) view), not BLAS."""
    w, x = inputs(QType.F32, 17)
    wf = w.view(np.float32)
    got = matmul(wf, QType.F32, x, exact)
    assert np.array_equal(got, matmul(w, QType.F32, x, exact))                      # bytes or float32
    assert np.array_equal(got, threaded(wf, QType.F32, x, exact, monkeypatch))
    for t in range(17):
        assert np.array_equal(got[t], matmul(wf, QType.F32, x[t:t + 1], exact)[0])


def test_bf16_rounding_is_bf16_round_bits():
    """The compiled rounding of x for BF16 weights is quantize.bf16_round_bits bit for bit: NaNs made quiet
    (signalling and negative ones too), infinities and signed zeros kept, ties to even, overflow to infinity."""
    from strata.quant.quantize import bf16_round_bits
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 500)) * 10.0 ** rng.integers(-40, 39, (3, 500))).astype(np.float32)
    x.view(np.uint32)[0, :10] = [0x7F800001, 0xFFFFFFFF, 0x7FBFFFFF, 0x7F800000, 0xFF800000, 0, 0x80000000,
                                 0x7F7FFFFF, 0x3F808000, 0x3F818000]   # NaNs, inf, zeros, max, ties down and up
    want = bf16_round_bits(x).astype(np.uint32) << 16
    assert np.array_equal(mm._bf16_round(x).view(np.uint32), want)


def test_matmul_errors():
    w, x = inputs(QType.Q8_0, 3)
    assert matmul(w, QType.Q8_0, x[:0]).shape == (0, ROWS)
    with pytest.raises(ValueError, match="bytes"):
        matmul(w[:, :-2], QType.Q8_0, x)
    with pytest.raises(ValueError, match="out"):
        matmul(w, QType.Q8_0, x, out=np.empty((3, ROWS + 1), np.float32))
    with pytest.raises(ValueError, match=r"\(T, n\)"):
        matmul(w, QType.Q8_0, x[0])


# (gate/up type, down type, E, F)
EXPERT_CASES = {"q2_0-q8_0": (QType.Q2_0, QType.Q8_0, 576, 320), "q4_k-q6_k": (QType.Q4_K, QType.Q6_K, 512, 256)}


def experts(case: str, seed: int = 0):
    """3 experts' stacked weights (keep them alive while addr is used), their (3, 3) row addresses, 5 rows of x."""
    wt, wd, e, f = EXPERT_CASES[case]
    rng = np.random.default_rng(seed)
    gate, up = (random_blocks(wt, (3 * f, e), rng, e ** -0.5) for _ in range(2))   # (3F, row_bytes)
    down = random_blocks(wd, (3 * e, f), rng, f ** -0.5)                           # (3E, row_bytes)
    base = np.array([a.__array_interface__["data"][0] for a in (gate, up, down)], np.int64)
    step = np.array([a.nbytes // 3 for a in (gate, up, down)], np.int64)
    addr = (base + np.arange(3)[:, None] * step).view(np.uint64)                  # (3, 3)
    x = rng.standard_normal((5, e)).astype(np.float32)
    return wt, wd, e, f, (gate, up, down), addr, x


ROWS_OF_X = np.array([0, 2, 3, 4, 1, 4, 0, 1])                     # (P,): x's row of each pair


@pytest.mark.parametrize("offsets", [[0, 4, 5, 8], [0, 5, 5, 8]], ids=["4-1-3", "5-0-3"])
@pytest.mark.parametrize("case", list(EXPERT_CASES))
def test_expert_rows_equal_one_token_batches(case, offsets, monkeypatch):
    wt, wd, e, f, weights, addr, x = experts(case)
    monkeypatch.setattr(qe, "SERIAL_BYTES", 0)                      # two threads whatever the size
    want = np.empty((len(ROWS_OF_X), e), np.float32)
    for j in range(3):
        for p in range(offsets[j], offsets[j + 1]):
            want[p] = expert_batch_at(addr[j:j + 1], x[ROWS_OF_X[p]], np.empty((1, e), np.float32), f, wt_gu=wt,
                                      wt_d=wd)[0]
    for threads in (1, 2):
        out = np.full((len(ROWS_OF_X), e), np.nan, np.float32)
        expert_batch_rows(addr, x, np.array(offsets), ROWS_OF_X, out, f, wt_gu=wt, wt_d=wd, n_threads=threads)
        assert np.array_equal(out, want), f"{case} {offsets} threads={threads}"


def test_expert_rows_errors():
    wt, wd, e, f, weights, addr, x = experts("q2_0-q8_0", seed=1)
    offsets, rows = np.array([0, 4, 5, 8]), ROWS_OF_X
    out = np.empty((len(rows), e), np.float32)
    with pytest.raises(ValueError, match="rows must lie"):
        expert_batch_rows(addr, x, offsets, np.where(rows == 4, 5, rows), out, f, wt_gu=wt, wt_d=wd)
    with pytest.raises(ValueError, match="offsets"):
        expert_batch_rows(addr, x, np.array([0, 5, 4, 8]), rows, out, f, wt_gu=wt, wt_d=wd)
    with pytest.raises(ValueError, match="no batched kernels"):
        expert_batch_rows(addr, x, offsets, rows, out, f, wt_gu=QType.BF16, wt_d=wd)
