"""QSA's pieces on their own: the compiled attention equals a float64 softmax over the same cells, and the cells of
a step's queries (one select_blocks call for every sequence's selecting queries, scores padded per sequence) equal
each sequence's own, ties at the cut going to the lower block index."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from strata.reference.qsa import QsaState, _cells, attend, block_scores, select_blocks

# budget 16, ratio 4: past 4 complete blocks a query keeps 4 of them plus up to 3 tail cells (C = 19 slots)
CFG = SimpleNamespace(idx_budget=16, compress_ratios=(4,), idx_dim=8, n_head_kv=2, head_dim=16,
                      block_topk=lambda il: 4)


def test_attend_is_softmax_over_the_valid_cells():
    rng = np.random.default_rng(0)
    n, H, Hkv, D, N, C = 5, 4, 2, 16, 40, 19
    K, V = (rng.standard_normal((N, Hkv, D)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    cells = rng.integers(0, N, (n, C))
    valid = rng.random((n, C)) < 0.7
    valid[:, 0] = True
    out = np.full((n, H, D), np.nan, np.float32)
    attend(K, V, q, cells, valid, out)
    for i in range(n):
        c = cells[i, valid[i]]
        for h in range(H):
            s = (K[c, h // 2].astype(np.float64) @ q[i, h]) / np.sqrt(D)
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ V[c, h // 2].astype(np.float64)
            assert np.allclose(out[i, h], want, rtol=1e-6, atol=1e-6)
    one = np.empty((1, H, D), np.float32)
    attend(K, V, q[2:3], cells[2:3], valid[2:3], one)
    assert np.array_equal(one[0], out[2])                   # a row does not depend on the others


def _state(blocks: np.ndarray) -> QsaState:
    st = QsaState.empty(SimpleNamespace(n_head_kv=2, head_dim=16, idx_dim=8))
    st.idx_blocks.extend(blocks)
    return st


def test_step_cells_equal_each_sequences_own():
    """Three sequences of different lengths in one step (runs of 1, 3 and 2 queries), block keys with exact score
    ties at the cut: the step's cells equal those of each run alone, and the ties keep the lower blocks."""
    rng = np.random.default_rng(1)
    base = rng.standard_normal((1, 8)).astype(np.float32)
    tied = np.repeat(base, 9, axis=0)                       # 9 identical block keys: every score ties
    tied[6] *= 2.0                                          # one clear winner past the cut
    states = [_state(tied), _state(rng.standard_normal((12, 8)).astype(np.float32)),
              _state(rng.standard_normal((6, 8)).astype(np.float32))]
    pos = np.array([37, 45, 46, 47, 22, 25])                # each sequence's queries, in step order
    segs = [(states[0], 0, 1), (states[1], 1, 3), (states[2], 4, 2)]
    iq = np.abs(rng.standard_normal((6, 2, 8))).astype(np.float32)
    iq[0] = np.abs(base)                                    # positive scores against the tied keys
    cells, valid = _cells(CFG, 0, segs, pos, iq)
    for st, a, n in segs:
        c, v = _cells(CFG, 0, [(st, 0, n)], pos[a:a + n], iq[a:a + n])
        assert np.array_equal(cells[a:a + n], c) and np.array_equal(valid[a:a + n], v)
    # the tied sequence: 9 complete blocks at position 37, top 4 = block 6 then the lowest tied ones 0, 1, 2
    nb = (37 + 1) // 4
    scores = block_scores(CFG, iq[:1], states[0].idx_blocks.view()[:nb])
    assert list(select_blocks(scores, 4)[0]) == [0, 1, 2, 6]
    want = [c for b in (0, 1, 2, 6) for c in range(4 * b, 4 * b + 4)] + [36, 37]
    assert list(cells[0][valid[0]]) == want
