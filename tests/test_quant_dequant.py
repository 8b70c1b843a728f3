"""Block geometry and dequantization: bit-exact against gguf-py for every format it knows, Q2_0 against
ggml-quants.c's definition restated here, fp16 helpers against numpy."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES

from strata.quant import QType, block_size, dequantize, dequantize_rows, row_bytes, type_size
from strata.quant.half import f16_decode, f16_encode

GGUF_TYPES = [t for t in QType if t not in (QType.Q2_0, QType.Q8_1, QType.Q8_K)]

# byte offsets of every fp16 field of a block (scales d/dmin/m); the rest of a block is codes
F16_FIELDS = {
    QType.Q4_0: [0], QType.Q4_1: [0, 2], QType.Q5_0: [0], QType.Q5_1: [0, 2], QType.Q8_0: [0],
    QType.Q2_K: [80, 82], QType.Q3_K: [108], QType.Q4_K: [0, 2], QType.Q5_K: [0, 2], QType.Q6_K: [208],
    QType.IQ2_XXS: [0], QType.IQ2_XS: [0], QType.IQ2_S: [0], QType.IQ3_XXS: [0], QType.IQ3_S: [0],
    QType.IQ4_NL: [0], QType.IQ4_XS: [0], QType.Q2_0: [0],
}
# fp16 edge scales: zeros, +-1, +-max, +-inf, smallest/largest subnormal, smallest normal, negative normal.
# NaN is left out: the compiled sign flip of the IQ formats may fold x * -1.0 into a negation, which
# differs from numpy only in the sign bit of a NaN.
EDGE_F16 = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0, np.inf, -np.inf, 2.0**-24, -(2.0**-24),
                     (1023 / 1024) * 2.0**-14, 2.0**-14, -3.5e-3, 7.25e-4], np.float16)


def edge_blocks(qt: QType, n_random: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 (nb, type_size): random codes; all-0x00 and all-0xFF code blocks; every fp16 field cycling
    through EDGE_F16 and random finite values."""
    ts = type_size(qt)
    raw = rng.integers(0, 256, (n_random + 2 * len(EDGE_F16), ts), dtype=np.uint8)
    raw[n_random:n_random + len(EDGE_F16)] = 0x00
    raw[n_random + len(EDGE_F16):] = 0xFF
    finite = rng.standard_normal(raw.shape[0]).astype(np.float16)
    for k, off in enumerate(F16_FIELDS[qt]):
        vals = np.where(np.arange(raw.shape[0]) % 3 == 0, np.resize(np.roll(EDGE_F16, k), raw.shape[0]), finite)
        raw[:, off:off + 2] = vals.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def iq_index_coverage(qt: QType, raw: np.ndarray) -> tuple[set[int], set[int]]:
    """(grid indices, sign patterns) used by the blocks, decoded independently of strata's kernels."""
    if qt == QType.IQ2_XXS:
        a = raw[:, 2:].view(np.uint32).reshape(-1, 8, 2)
        grid = a[..., 0].copy().view(np.uint8)
        signs = (a[..., 1:2] >> np.array([0, 7, 14, 21], np.uint32)) & 127
    elif qt == QType.IQ2_XS:
        q = raw[:, 2:66].view(np.uint16)
        grid, signs = q & 511, q >> 9
    elif qt == QType.IQ2_S:
        qh = (raw[:, 66:74, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
        grid = raw[:, 2:34].astype(np.int64) | (qh.reshape(-1, 32).astype(np.int64) << 8)
        signs = raw[:, 34:66]
    elif qt == QType.IQ3_XXS:
        grid = raw[:, 2:66]
        signs = (raw[:, 66:98].view(np.uint32)[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & 127
    else:  # IQ3_S
        qh = (raw[:, 66:74, None] >> np.arange(8, dtype=np.uint8)) & 1
        grid = raw[:, 2:66].astype(np.int64) | (qh.reshape(-1, 64).astype(np.int64) << 8)
        signs = raw[:, 74:106]
    return set(np.unique(grid).tolist()), set(np.unique(signs).tolist())


def test_geometry_matches_gguf():
    for qt in GGUF_TYPES + [QType.Q8_K]:
        assert (block_size(qt), type_size(qt)) == GGML_QUANT_SIZES[G(int(qt))], qt.name
    assert (block_size(QType.Q2_0), type_size(QType.Q2_0)) == (64, 18)   # block_q2_0: fp16 + 64/4 bytes
    assert (block_size(QType.Q8_1), type_size(QType.Q8_1)) == (32, 36)   # block_q8_1: 2 fp16 + 32
    assert row_bytes(QType.Q4_K, 2560 * 4) == 10 * 4 * 144
    assert row_bytes(QType.Q2_0, 640) == 10 * 18


def test_row_bytes_rejects_partial_blocks():
    with pytest.raises(ValueError, match="multiple"):
        row_bytes(QType.Q4_K, 640)
    with pytest.raises(ValueError, match="unsupported ggml type id 99"):
        block_size(99)


@pytest.mark.parametrize("qt", GGUF_TYPES, ids=lambda t: t.name)
def test_dequantize_bit_exact_vs_gguf(qt):
    rng = np.random.default_rng(int(qt))
    if qt in (QType.F32, QType.F16, QType.BF16):
        bits = rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
        x = bits.view(np.float32)
        with np.errstate(over="ignore"):
            raw = {QType.F32: x, QType.F16: x.astype(np.float16), QType.BF16: (bits >> 16).astype(np.uint16)}[qt]
        want = gq.dequantize(np.ascontiguousarray(raw).view(np.uint8), G(int(qt))).reshape(-1)
        for form in (raw, np.ascontiguousarray(raw).view(np.uint8)):
            got = dequantize(form, qt).reshape(-1)
            assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
        return
    n_random = 4096 if qt in (QType.IQ2_XS, QType.IQ2_S, QType.IQ3_S) else 512
    raw = edge_blocks(qt, n_random, rng)
    with np.errstate(invalid="ignore", over="ignore"):
        want = gq.dequantize(raw, G(int(qt)))
    got = dequantize(raw, qt)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    if qt in (QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS, QType.IQ3_S):
        grid, signs = iq_index_coverage(qt, raw)
        n_grid = {QType.IQ2_XXS: 256, QType.IQ2_XS: 512, QType.IQ2_S: 1024, QType.IQ3_XXS: 256, QType.IQ3_S: 512}[qt]
        n_signs = 128 if qt in (QType.IQ2_XXS, QType.IQ2_XS, QType.IQ3_XXS) else 256
        assert len(grid) == n_grid and len(signs) == n_signs


def q2_0_reference(raw: np.ndarray) -> np.ndarray:
    """ggml-quants.c dequantize_row_q2_0, one element at a time: y = ((int)q - 1) * d,
    q = (qs[j / 4] >> ((j % 4) * 2)) & 3."""
    blocks = raw.reshape(-1, 18)
    out = np.empty((blocks.shape[0], 64), np.float32)
    for i, blk in enumerate(blocks):
        d = np.float32(blk[0:2].view(np.float16)[0])
        for j in range(64):
            q = (int(blk[2 + j // 4]) >> ((j % 4) * 2)) & 3
            out[i, j] = np.float32(q - 1) * d
    return out.reshape(*raw.shape[:-1], raw.shape[-1] // 18 * 64)


def test_q2_0_matches_ggml_definition():
    rng = np.random.default_rng(42)
    raw = edge_blocks(QType.Q2_0, 200, rng).reshape(-1, 4 * 18)
    with np.errstate(invalid="ignore"):
        want = q2_0_reference(raw)
    got = dequantize(raw, QType.Q2_0)
    assert got.shape == (raw.shape[0], 256)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # the four codes of a byte are elements 4k..4k+3: byte 0b11100100 -> codes 0,1,2,3 -> -d, 0, d, 2d
    blk = np.zeros(18, np.uint8)
    blk[0:2] = np.array([0.5], np.float16).view(np.uint8)
    blk[2] = 0b11100100
    assert dequantize(blk, QType.Q2_0)[:5].tolist() == [-0.5, 0.0, 0.5, 1.0, -0.5]


def test_activation_formats_dequantize_by_definition():
    rng = np.random.default_rng(3)
    k = rng.integers(0, 256, (5, 292), dtype=np.uint8)
    k[:, 0:4] = rng.standard_normal(5).astype(np.float32).view(np.uint8).reshape(5, 4)
    want = k[:, 0:4].copy().view(np.float32) * k[:, 4:260].view(np.int8).astype(np.float32)
    assert np.array_equal(dequantize(k, QType.Q8_K), want)
    q1 = rng.integers(0, 256, (5, 36), dtype=np.uint8)
    q1[:, 0:2] = rng.standard_normal(5).astype(np.float16).view(np.uint8).reshape(5, 2)
    want = q1[:, 4:].view(np.int8).astype(np.float32) * q1[:, 0:2].copy().view(np.float16).astype(np.float32)
    assert np.array_equal(dequantize(q1, QType.Q8_1), want)


def test_dequantize_shapes_and_rows():
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, (6, 4, 2 * 144), dtype=np.uint8)
    raw.reshape(-1, 144)[:, 0:4] = np.array([0.01, 0.002], np.float16).view(np.uint8)
    full = dequantize(raw, QType.Q4_K)
    assert full.shape == (6, 4, 512)
    assert np.array_equal(dequantize(raw.reshape(-1), QType.Q4_K), full.reshape(-1))
    assert dequantize(raw.reshape(-1), QType.Q4_K, shape=(24, 512)).shape == (24, 512)
    table = raw.reshape(24, 288)
    rows = np.array([23, 0, 5, 5])
    assert np.array_equal(dequantize_rows(table, QType.Q4_K, rows), full.reshape(24, 512)[rows])
    with pytest.raises(ValueError, match="whole number"):
        dequantize(raw[..., :100], QType.Q4_K)


def test_f16_helpers_match_numpy():
    rng = np.random.default_rng(9)
    bits = rng.integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32)
    near = (bits & 0x87FFFFFF) | 0x30000000   # exponents around fp16's range: subnormals, ties, overflow
    edges = np.array([0x477FF000, 0x477FEFFF, 0x38800000, 0x387FFFFF, 0x33000000, 0x33000001, 0x32FFFFFF,
                      0x7F800000, 0x80000000, 0x3F801000, 0x3F803000], np.uint32)
    for u in (bits, near, edges):
        a = u.view(np.float32)
        h = np.empty(a.shape[0], np.uint16)
        f16_encode(a, h)
        with np.errstate(over="ignore"):
            assert np.array_equal(h, a.astype(np.float16).view(np.uint16))
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(1 << 16, np.float32)
    f16_decode(h, out)
    assert np.array_equal(out.view(np.uint32), h.view(np.float16).astype(np.float32).view(np.uint32))
