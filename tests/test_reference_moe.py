"""routed_experts: every row's routed experts in one compiled batch over the layer's stacked tensors (separate or
fused gate|up) equal expert_ffn over each expert's Mats on each row alone, bit for bit; float types go expert by
expert."""

from __future__ import annotations

import numpy as np
import pytest

from strata.model.weights import LayerWeights, Mat
from strata.quant import QType, random_blocks
from strata.reference.moe import expert_ffn, routed_experts

E, F, N = 256, 128, 6            # hidden, expert width, experts


def _layer(wt: QType, wd: QType, fused: bool, exact: bool) -> LayerWeights:
    rng = np.random.default_rng(int(wt) + 7 * fused)
    gate, up = (random_blocks(wt, (N * F, E), rng, E ** -0.5) for _ in range(2))
    down = random_blocks(wd, (N * E, F), rng, F ** -0.5)
    raw = (lambda a, t: a.view(np.float32) if t == QType.F32 else a)
    lw = LayerWeights(0, "gdn")
    if fused:                    # expert e's rows: its gate rows, then its up rows
        gu = np.concatenate([gate.reshape(N, F, -1), up.reshape(N, F, -1)], axis=1).reshape(N * 2 * F, -1)
        lw.ffn_gate_up_exps = Mat("gate_up", wt, raw(gu, wt), 2 * F, E, N, exact)
    else:
        lw.ffn_gate_exps = Mat("gate", wt, raw(gate, wt), F, E, N, exact)
        lw.ffn_up_exps = Mat("up", wt, raw(up, wt), F, E, N, exact)
    lw.ffn_down_exps = Mat("down", wd, raw(down, wd), E, F, N, exact)
    return lw


@pytest.mark.parametrize("wt,wd,fused,exact", [(QType.Q2_0, QType.Q8_0, False, False),
                                               (QType.Q2_0, QType.Q8_0, True, False),
                                               (QType.Q2_0, QType.Q8_0, True, True),
                                               (QType.F32, QType.F32, True, False)],
                         ids=["q2_0", "q2_0-fused", "q2_0-fused-exact", "f32-fused"])
def test_routed_experts_equal_expert_ffn_per_row(wt, wd, fused, exact):
    lw = _layer(wt, wd, fused, exact)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, E)).astype(np.float32)
    ids = np.array([[0, 3], [3, 5], [1, 0], [5, 2], [3, 4]], np.int32)      # (T, k): experts shared across rows
    got = routed_experts(lw, x, ids)
    assert got.shape == (5, 2, E)
    for t in range(5):
        for j in range(2):
            want = expert_ffn(*lw.expert(int(ids[t, j])), x[t:t + 1])[0]
            assert np.array_equal(got[t, j], want), f"row {t} expert {ids[t, j]}"
