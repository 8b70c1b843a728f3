"""Quantizers (bytes equal to gguf-py where it can quantize; stated error bounds otherwise) and
random_blocks (valid blocks, requested spread)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf import quants as gq

from strata.quant import QType, block_size, dequantize, quantize, random_blocks, row_bytes


def data(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """Gaussian rows with the awkward cases: an all-zero block, tiny blocks, outliers, exact halves, ties."""
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[0, :64] = 0.0
    x[1, :256] *= 1e-6
    x[2, 7] = 50.0
    x[3, :32] = np.arange(32) * 0.5 - 8.0            # many exact .5 steps at every scale
    x[4, :32] = -x[4, :32].max() * np.sign(np.arange(32) - 15.5)
    return x


@pytest.mark.parametrize("qt", [QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q5_0], ids=lambda t: t.name)
def test_bytes_equal_gguf(qt):
    x = data(np.random.default_rng(1), 8, 1024)
    want = np.ascontiguousarray(gq.quantize(x, G(int(qt)))).view(np.uint8).reshape(8, -1)
    got = quantize(x, qt)
    assert got.dtype == np.uint8 and got.shape == (8, row_bytes(qt, 1024))
    assert np.array_equal(got, want)


def block_view(x: np.ndarray, qt: QType) -> np.ndarray:
    return x.reshape(-1, block_size(qt))


# per-element |x - dequant(quantize(x))| <= factor * amax(block) + qmax * |d - fp16(d)|, from each
# format's rounding rule, with |d - fp16(d)| <= 2^-11 |d| + 2^-25 (fp16 rounding, subnormals included):
#   Q8_0: d = amax/127, round to nearest -> d/2;  Q4_0: d = max/-8, the +8 end clips -> d = amax/8;
#   Q5_0: likewise amax/16;  Q2_0: d = amax, round(x/d) in {-1, 0, 1} -> amax/2
# (factor, d / amax, largest |code|)
MAX_ERR = {QType.Q8_0: (0.5 / 127, 1 / 127, 127), QType.Q4_0: (1 / 8, 1 / 8, 8),
           QType.Q5_0: (1 / 16, 1 / 16, 16), QType.Q2_0: (0.5, 1.0, 2)}
# relative RMS error on Gaussian data, the levels ggml's quantizers reach (measured ~0.075, 0.020, 0.086, 0.086)
MAX_RMSE = {QType.Q4_K: 0.09, QType.Q6_K: 0.025, QType.IQ4_NL: 0.1, QType.IQ4_XS: 0.1}


@pytest.mark.parametrize("qt", list(MAX_ERR), ids=lambda t: t.name)
def test_round_trip_max_error(qt):
    x = data(np.random.default_rng(2), 8, 1024)
    y = dequantize(quantize(x, qt), qt)
    amax = np.abs(block_view(x, qt)).max(1, keepdims=True).astype(np.float64)
    err = np.abs(block_view(y - x, qt))
    factor, d_per_amax, qmax = MAX_ERR[qt]
    assert np.all(err <= factor * amax + qmax * (d_per_amax * amax * 2.0**-11 + 2.0**-25))
    assert np.all(y[0, :64] == 0)


def test_q2_0_codes_follow_ggml_rule():
    # quantize_row_q2_0_ref: d = amax, q = clamp(roundf(x/d) + 1, 0, 3); halves round away from zero
    x = np.array([[1.0, -1.0, 0.5, -0.5, 0.49, -0.49, 0.0, 0.25] * 8], np.float32)
    raw = quantize(x, QType.Q2_0)
    assert raw[0, 0:2].view(np.float16)[0] == 1.0
    codes = (raw[0, 2:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
    assert codes.reshape(-1)[:8].tolist() == [2, 0, 2, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("qt", list(MAX_RMSE), ids=lambda t: t.name)
def test_round_trip_rmse(qt):
    x = np.random.default_rng(3).standard_normal((16, 1024)).astype(np.float32)
    y = dequantize(quantize(x, qt), qt)
    rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2))
    assert rel <= MAX_RMSE[qt]
    assert np.all(dequantize(quantize(np.zeros((1, 256), np.float32), qt), qt) == 0)


def test_float_formats_round_trip():
    x = data(np.random.default_rng(4), 6, 512)
    assert np.array_equal(dequantize(quantize(x, QType.F32), QType.F32), x)
    y16 = dequantize(quantize(x, QType.F16), QType.F16)
    assert np.all(np.abs(y16 - x) <= np.abs(x) * 2.0**-11 + 2.0**-25)
    yb = dequantize(quantize(x, QType.BF16), QType.BF16)
    assert np.all(np.abs(yb - x) <= np.abs(x) * 2.0**-8)


def test_quantize_shapes_and_errors():
    x = np.random.default_rng(5).standard_normal((3, 2, 256)).astype(np.float32)
    assert quantize(x, QType.Q4_K).shape == (3, 2, 144)
    with pytest.raises(ValueError, match="no quantizer for Q3_K"):
        quantize(x, QType.Q3_K)
    with pytest.raises(ValueError, match="multiple"):
        quantize(x[..., :100], QType.Q8_0)


ALL_TYPES = list(QType)


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda t: t.name)
def test_random_blocks_valid_and_scaled(qt):
    rng = np.random.default_rng(int(qt))
    raw = random_blocks(qt, (32, 2048), rng, 0.02)
    assert raw.dtype == np.uint8 and raw.shape == (32, row_bytes(qt, 2048))
    y = dequantize(raw, qt).astype(np.float64)
    assert np.all(np.isfinite(y))
    assert 0.017 <= y.std() <= 0.023            # std within 15% of the requested scale
    assert abs(y.mean()) <= 0.15 * 0.02         # no bias that would swamp the spread


def test_random_q2_0_code_distribution_and_speed():
    rng = np.random.default_rng(7)
    t = time.perf_counter()
    raw = random_blocks(QType.Q2_0, (640, 2560 * 8), rng, 1.0)
    elapsed = time.perf_counter() - t
    codes = (raw.reshape(-1, 18)[:, 2:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
    freq = np.bincount(codes.reshape(-1), minlength=4) / codes.size
    assert np.allclose(freq, [3 / 8, 3 / 8, 1 / 8, 1 / 8], atol=2e-3)
    assert elapsed < 2.0, f"13M Q2_0 weights took {elapsed:.2f}s"
