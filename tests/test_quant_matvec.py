"""Quantized matvec: the activation is quantized as llama.cpp's x86 CPU backend does, the integer block
sums are ggml's (result = sum_i w_i * a_i to float32 rounding), the error against float64 stays inside
what the activation rounding allows, exact mode is float64-accurate, row ranges and threads compose."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from strata.quant import (ACT_TYPE, QType, activation_values, block_size, dequantize, matvec, matvec_parallel,
                          matvec_prepared, prepare_activation, random_blocks, split_rows)
from strata.quant.formats import readonly

QUANT_WEIGHTS = [t for t in QType if t not in (QType.F32, QType.F16, QType.BF16, QType.Q8_1, QType.Q8_K)]
FLOAT_WEIGHTS = [QType.F32, QType.F16, QType.BF16]
ROWS = 37


def k_for(qt: QType) -> int:
    return {32: 800, 64: 832, 256: 1024}.get(block_size(qt), 1024)   # Q2_0: 13 blocks, an odd count


def case(qt: QType, k: int | None = None, seed: int = 0):
    rng = np.random.default_rng(seed + int(qt))
    k = k or k_for(qt)
    w = random_blocks(qt, (ROWS, k), rng, 0.05)
    x = rng.standard_normal(k).astype(np.float32)
    x[: k // 8] *= 4.0                                  # uneven block maxima
    return w, x


def act_error_bound(act) -> np.ndarray:
    """Per element bound on |x_i - a_i| implied by the activation format (float64 (n,))."""
    x = act.v.astype(np.float64)
    if act.atype in (QType.Q8_0, QType.Q8_1):
        # q = round(x * 127/amax) -> |x - q * amax/127| <= amax/254; d stored as fp16 adds 127 * |d - fp16(d)|
        d = np.abs(x).reshape(-1, 32).max(1) / 127
        e = 0.5 * d + 127 * (2.0**-11 * d + 2.0**-25)
        return np.repeat(e * (1 + 1e-6), 32)
    if act.atype == QType.Q8_K:
        d = np.abs(x).reshape(-1, 256).max(1) / 127       # d = 1/iscale, kept in float32
        return np.repeat(0.5 * d * (1 + 1e-6), 256)
    if act.atype == QType.F16:
        return np.abs(x) * 2.0**-11 + 2.0**-25
    if act.atype == QType.BF16:
        return np.abs(x) * 2.0**-8
    return np.zeros_like(x)


def test_act_type_is_ggml_vec_dot_type():
    # type_traits_cpu[...].vec_dot_type in ggml-cpu.c
    want = {QType.F32: QType.F32, QType.F16: QType.F16, QType.BF16: QType.BF16, QType.Q4_0: QType.Q8_0,
            QType.Q4_1: QType.Q8_1, QType.Q5_0: QType.Q8_0, QType.Q5_1: QType.Q8_1, QType.Q8_0: QType.Q8_0,
            QType.Q2_0: QType.Q8_0, QType.IQ4_NL: QType.Q8_0}
    want.update({t: QType.Q8_K for t in (QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ2_XXS,
                                         QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS, QType.IQ3_S, QType.IQ4_XS)})
    assert ACT_TYPE == want


def test_q8_0_activation_is_x86_quantize_row_q8_0():
    rng = np.random.default_rng(11)
    x = rng.standard_normal(4096).astype(np.float32) * np.float32(3.0)
    x[:32] = 0.0
    x[32:64] = np.arange(32, dtype=np.float32) - 15.5     # x * 127/amax lands on many .5 ties
    act = prepare_activation(x, QType.Q8_0)
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * idv)                             # _mm256_round_ps(_MM_ROUND_NEAREST): ties to even
    assert np.array_equal(act.q, q.astype(np.int8).reshape(-1))
    assert np.array_equal(act.d, d.reshape(-1))
    s1 = prepare_activation(x, QType.Q4_1).aux[0]         # Q8_1: s = fp16(d_f32 * sum q)
    s_want = ((amax / np.float32(127)).reshape(-1) * q.sum(1).astype(np.float32)).astype(np.float16).astype(np.float32)
    assert np.array_equal(s1, s_want)


def test_q8_k_activation_is_quantize_row_q8_K_ref():
    rng = np.random.default_rng(12)
    x = rng.standard_normal(2048).astype(np.float32)
    x[:256] = 0.0
    x[300] = -9.0                                         # the signed max sets the sign of iscale
    act = prepare_activation(x, QType.Q4_K)
    for b, blk in enumerate(x.reshape(-1, 256)):
        mx = blk[np.argmax(np.abs(blk))]
        if mx == 0:
            assert act.d[b] == 0 and not act.q[256 * b:256 * b + 256].any()
            continue
        iscale = np.float32(-127.0) / mx
        q = np.minimum(127, np.rint(iscale * blk)).astype(np.int8)
        assert np.array_equal(act.q[256 * b:256 * b + 256], q)
        assert act.d[b] == np.float32(1.0) / iscale
        assert np.array_equal(act.aux[0][16 * b:16 * b + 16], q.reshape(16, 16).sum(1))


@pytest.mark.parametrize("qt", QUANT_WEIGHTS + FLOAT_WEIGHTS, ids=lambda t: t.name)
def test_matvec_within_activation_contract(qt):
    w, x = case(qt)
    act = prepare_activation(x, qt)
    wf = dequantize(w, qt).astype(np.float64)
    ref = wf @ x.astype(np.float64)
    y = matvec(w, qt, x)
    bound = np.abs(wf) @ act_error_bound(act) + 1e-5 * (np.abs(wf) @ np.abs(x.astype(np.float64)))
    assert y.dtype == np.float32 and y.shape == (ROWS,)
    assert np.all(np.abs(y - ref) <= bound)
    assert np.abs(y - ref).max() > 0 or qt == QType.F32   # the quantized activation is really used


@pytest.mark.parametrize("qt", QUANT_WEIGHTS, ids=lambda t: t.name)
def test_matvec_integer_sums_are_ggml(qt):
    """y equals sum_i w_i * a_i with a the quantized activation, to float32 accumulation: one code off
    anywhere would move a row by ~|w_i a_i| ~ 1e-3 of the bound's scale, far over the 2e-5 allowed."""
    for k in sorted({k_for(qt), 2 * k_for(qt)}):
        w, x = case(qt, k, seed=1)
        act = prepare_activation(x, qt)
        a = activation_values(act)
        wf = dequantize(w, qt).astype(np.float64)
        want = wf @ a
        slack = 2e-5 * (np.abs(wf) @ np.abs(a))
        if act.atype == QType.Q8_1:                        # ggml's min term uses s = fp16(d_f32 * sum q)
            ts = 20 if qt == QType.Q4_1 else 24
            mins = w.reshape(ROWS, -1, ts)[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
            qs = act.q.reshape(-1, 32).astype(np.float64).sum(1)
            dq = act.d.astype(np.float64)
            slack += np.abs(mins) @ (np.abs(qs) * (2.0**-11 * dq + 2.0**-25) + 2.0**-11 * np.abs(act.aux[0]) + 2.0**-25)
        y = matvec_prepared(w, qt, act)
        assert np.all(np.abs(y - want) <= slack), np.abs(y - want).max()


@pytest.mark.parametrize("qt", QUANT_WEIGHTS + FLOAT_WEIGHTS, ids=lambda t: t.name)
def test_exact_mode_is_float64_accurate(qt):
    w, x = case(qt, seed=2)
    wf = dequantize(w, qt).astype(np.float64)
    ref = wf @ x.astype(np.float64)
    y = matvec(w, qt, x, exact=True)
    assert np.all(np.abs(y - ref) <= 1e-6 * (np.abs(wf) @ np.abs(x.astype(np.float64))))


@pytest.mark.parametrize("qt", [QType.Q2_0, QType.Q8_0, QType.Q4_K, QType.IQ4_XS, QType.Q6_K, QType.BF16],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("exact", [False, True])
def test_row_ranges_write_only_their_rows(qt, exact):
    w, x = case(qt, seed=3)
    act = prepare_activation(x, qt, exact)
    full = matvec_prepared(w, qt, act)
    out = np.full(ROWS, np.nan, np.float32)
    for r0, r1 in [(3, 11), (11, 11), (20, ROWS)]:
        matvec_prepared(w, qt, act, out, r0, r1)
    assert np.isnan(out[:3]).all() and np.isnan(out[11:20]).all()
    assert np.array_equal(out[3:11], full[3:11]) and np.array_equal(out[20:], full[20:])
    with pytest.raises(ValueError, match="row range"):
        matvec_prepared(w, qt, act, out, 5, ROWS + 1)


@pytest.mark.parametrize("qt", [QType.Q2_0, QType.Q8_0, QType.Q4_K, QType.IQ4_XS, QType.IQ2_XXS, QType.F16],
                         ids=lambda t: t.name)
def test_thread_pool_equals_serial_bitwise(qt):
    w, x = case(qt, seed=4)
    serial = matvec(w, qt, x)
    with ThreadPoolExecutor(3) as pool:
        for n in (1, 2, 5, 64):
            par = matvec_parallel(w, qt, x, pool=pool, n_threads=n)
            assert np.array_equal(par.view(np.uint32), serial.view(np.uint32))
    assert np.array_equal(matvec_parallel(w, qt, x), serial)


def test_split_rows_covers_rows_on_aligned_cuts():
    for rows, parts in [(37, 4), (640, 16), (7, 3), (2560, 7)]:
        spans = split_rows(rows, parts)
        assert spans[0][0] == 0 and spans[-1][1] == rows and len(spans) <= parts
        assert all(a < b and a % 8 == 0 for a, b in spans)
        assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))


def test_float_weights_accept_typed_and_raw():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(256).astype(np.float32)
    wf = rng.standard_normal((9, 256)).astype(np.float32)
    typed = {QType.F32: wf, QType.F16: wf.astype(np.float16), QType.BF16: (wf.view(np.uint32) >> 16).astype(np.uint16)}
    for qt, arr in typed.items():
        assert np.array_equal(matvec(arr, qt, x), matvec(arr.view(np.uint8), qt, x))
        # read-only bytes, as a GGUF mapping gives them (a memmap, or a plain view): the kernel sees the float type
        ro = readonly(arr.view(np.uint8))
        assert np.array_equal(matvec(arr, qt, x), matvec(ro, qt, x))
        assert np.array_equal(matvec(arr, qt, x), matvec(ro.view(np.memmap), qt, x))


def test_mismatches_are_rejected():
    w, x = case(QType.Q4_K)
    with pytest.raises(ValueError, match="prepared for Q8_0"):
        matvec_prepared(w, QType.Q4_K, prepare_activation(x, QType.Q8_0))
    with pytest.raises(ValueError, match="take"):
        matvec(w[:, :-144], QType.Q4_K, x)
    with pytest.raises(ValueError, match="float32"):
        matvec(w, QType.Q4_K, x, out=np.empty(ROWS, np.float64))
    with pytest.raises(ValueError, match="multiple"):
        prepare_activation(x[:100], QType.Q4_K)
