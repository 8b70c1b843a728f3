"""The compiled expert batch equals reference.moe.expert_ffn over Mats bit for bit (contract and exact modes,
any thread count, any caller thread), fills every output row, and the CPU pool built on it keeps that.

Each (type, mode) pair costs numba ~5 s to compile on a cold cache: the pairs here are few and the
Q2_0 gate/up + Q8_0 down pair is the one test_scheduler's realistic model compiles anyway.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

from strata.host.experts import CpuExpertPool, ExpertBlob, ExpertSlice
from strata.model.weights import Mat
from strata.quant import QType, random_blocks, row_bytes
import strata.quant.experts as qe
from strata.quant.experts import batched, expert_batch, max_threads
from strata.reference.moe import expert_ffn

# (gate/up type, down type, E, F, n_expert)
CASES = {
    "q2_0-q8_0": (QType.Q2_0, QType.Q8_0, 576, 320, 5),        # Q2_0 rows of 9 blocks: quads plus a lone tail
    "q2_0-real": (QType.Q2_0, QType.Q2_0, 2560, 640, 3),       # the model's geometry; down K=640: quads plus a pair
    "q4_k-iq4_xs": (QType.Q4_K, QType.IQ4_XS, 512, 256, 4),
    "q5_1-iq2_xxs": (QType.Q5_1, QType.IQ2_XXS, 256, 256, 3),   # Q8_1 activation; a kernel with grid tables
}


def make(case: str, seed: int = 0):
    wt, wd, E, F, n = CASES[case]
    rng = np.random.default_rng(seed)
    gate = random_blocks(wt, (n * F, E), rng, 1 / np.sqrt(E))          # (n * F, row_bytes)
    up = random_blocks(wt, (n * F, E), rng, 1 / np.sqrt(E))
    down = random_blocks(wd, (n * E, F), rng, 1 / np.sqrt(F))          # (n * E, row_bytes)
    x = rng.standard_normal(E).astype(np.float32)
    x[:E // 8] *= 4.0                                                  # uneven block maxima
    return wt, wd, E, F, n, gate, up, down, x


def reference(wt, wd, E, F, n, gate, up, down, x, ids, exact):
    mats = [Mat("gate", wt, gate, F, E, n, exact), Mat("up", wt, up, F, E, n, exact),
            Mat("down", wd, down, E, F, n, exact)]
    return np.stack([expert_ffn(*(m[int(e)] for m in mats), x) for e in ids])


@pytest.mark.parametrize("case,exact", [("q2_0-q8_0", False), ("q2_0-q8_0", True), ("q2_0-real", False),
                                        ("q4_k-iq4_xs", False), ("q5_1-iq2_xxs", False)])
def test_batch_equals_reference(case, exact, monkeypatch):
    wt, wd, E, F, n, gate, up, down, x = make(case)
    ids = np.array([n - 1, 0, n - 1, 1][:n + 1], np.int32)          # out of order, one expert twice
    want = reference(wt, wd, E, F, n, gate, up, down, x, ids, exact)
    monkeypatch.setattr(qe, "SERIAL_BYTES", 0)                      # threads whatever the size
    for threads in (1, max_threads()):
        out = np.full((len(ids), E), np.nan, np.float32)              # every row must be written
        expert_batch(gate, up, down, ids, x, out, wt_gu=wt, wt_d=wd, exact=exact, n_threads=threads)
        assert np.array_equal(out, want), f"{case} exact={exact} threads={threads}"


@pytest.mark.parametrize("case", ["q2_0-q8_0", "q4_k-iq4_xs"])
def test_tokens_batch_equals_one_token_batches(case):
    """ids (T, k) with x (T, E): every token's experts in one batch (shared experts grouped) equal each token's own
    batch, and T = 0 is an empty result."""
    wt, wd, E, F, n, gate, up, down, _ = make(case, seed=5)
    rng = np.random.default_rng(6)
    X = rng.standard_normal((4, E)).astype(np.float32)
    ids = np.array([[0, 2], [2, 1], [n - 1, 0], [1, 2]], np.int32)   # (T, k): experts shared across tokens
    got = np.full((4, 2, E), np.nan, np.float32)
    assert expert_batch(gate, up, down, ids, X, got, wt_gu=wt, wt_d=wd) is got
    for t in range(4):
        assert np.array_equal(got[t], expert_batch(gate, up, down, ids[t], X[t], wt_gu=wt, wt_d=wd)), f"token {t}"
    assert expert_batch(gate, up, down, ids[:0], X[:0], wt_gu=wt, wt_d=wd).shape == (0, 2, E)


def test_fused_gate_up_views_and_edge_cases():
    """A fused gate|up tensor passes as two (n_expert, F, row_bytes) views; no experts is an empty result; bad
    ids and shapes are errors."""
    wt, wd, E, F, n, gate, up, down, x = make("q2_0-q8_0", seed=1)
    fused = np.concatenate([gate.reshape(n, F, -1), up.reshape(n, F, -1)], axis=1)     # (n, 2F, row_bytes)
    ids = np.array([3, 1])
    got = expert_batch(fused[:, :F], fused[:, F:], down, ids, x, wt_gu=wt, wt_d=wd)
    assert np.array_equal(got, reference(wt, wd, E, F, n, gate, up, down, x, ids, False))
    assert expert_batch(gate, up, down, np.array([], np.int32), x, wt_gu=wt, wt_d=wd).shape == (0, E)
    with pytest.raises(ValueError, match="ids"):
        expert_batch(gate, up, down, [n], x, wt_gu=wt, wt_d=wd)
    with pytest.raises(ValueError, match="down_w"):
        expert_batch(gate, up, down[:, :-2], [0], x, wt_gu=wt, wt_d=wd)


@pytest.mark.parametrize("wt,wd", [(QType.F32, QType.F32), (QType.BF16, QType.Q8_0)], ids=["f32", "bf16-q8_0"])
def test_float_types_go_expert_by_expert(wt, wd):
    """F32 (float32 arrays, as Mat holds them, through BLAS) and BF16 are not batched: the per-matvec path."""
    assert not batched(wt, wd)
    rng = np.random.default_rng(2)
    E, F, n = 256, 128, 3
    g, u = (random_blocks(wt, (n * F, E), rng, 0.05) for _ in range(2))
    d = random_blocks(wd, (n * E, F), rng, 0.05)
    if wt == QType.F32:
        g, u = g.view(np.float32), u.view(np.float32)
        d = d.view(np.float32)
    x = rng.standard_normal(E).astype(np.float32)
    ids = [2, 0]
    for exact in (False, True):
        got = expert_batch(g, u, d, ids, x, wt_gu=wt, wt_d=wd, exact=exact)
        assert np.array_equal(got, reference(wt, wd, E, F, n, g, u, d, x, ids, exact))


def test_worker_threads_at_once():
    """Calls from several threads at once (the launches serialize on a lock; workqueue would abort otherwise)."""
    wt, wd, _, _, n, gate, up, down, x = make("q2_0-q8_0", seed=3)
    want = {e: expert_batch(gate, up, down, [e], x, wt_gu=wt, wt_d=wd)[0] for e in range(n)}
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda e: expert_batch(gate, up, down, [e], x, wt_gu=wt, wt_d=wd), list(range(n)) * 4))
    for i, o in enumerate(outs):
        assert np.array_equal(o[0], want[i % n])


@pytest.mark.parametrize("exact", [False, True])
def test_pool_waves_match_reference(exact):
    """The CPU pool: blobs already in memory go in one batch, late ones in later waves; parts keep the order the
    blobs were given in and equal the reference; a failed read fails the batch."""
    wt, wd, E, F, n, gate, up, down, x = make("q2_0-q8_0", seed=4)
    slices = (ExpertSlice(wt, F, E, row_bytes(wt, E), 0, 0), ExpertSlice(wt, F, E, row_bytes(wt, E), 0, 0),
              ExpertSlice(wd, E, F, row_bytes(wd, F), 0, 0))
    ids = [4, 2, 0, 3, 1]
    blobs = []
    for e in ids:
        b = ExpertBlob(0, e, slices)
        for view, w, rows in ((b.gate, gate, F), (b.up, up, F), (b.down, down, E)):
            view[:] = w[e * rows:(e + 1) * rows]
        blobs.append(b)
    futs = [Future() for _ in ids]
    for f, b in list(zip(futs, blobs))[:2]:
        f.set_result(b)                               # in host memory before the call
    pool = CpuExpertPool(max_threads(), exact)
    try:
        one = np.arange(len(ids) + 1), np.zeros(len(ids), np.int64)     # a decode step: every expert serves row 0
        job = pool.run(slices, x[None], futs, *one)
        for f, b in list(zip(futs, blobs))[2:]:
            f.set_result(b)
        res = job.result(timeout=60)
        bad = [Future(), Future()]
        job = pool.run(slices, x[None], bad, np.arange(3), np.zeros(2, np.int64))
        bad[0].set_result(blobs[0])
        bad[1].set_exception(OSError("read failed"))
        with pytest.raises(OSError, match="read failed"):
            job.result(timeout=60)
    finally:
        pool.close()
    assert res.blobs == blobs and res.t1 >= res.t0
    assert np.array_equal(res.parts, reference(wt, wd, E, F, n, gate, up, down, x, ids, exact))
