"""Valid random blocks of any format, generated directly as codes and scales (no float quantization):
fast enough for the synthetic-model builder, which fills ~120e9 Q2_0 weights expert slice by expert slice.

Code fields are uniform random bytes (every bit pattern is a valid code in these formats); the scale
fields are set so that dequantized values have roughly standard deviation `scale` and, for the formats
with a min (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K), roughly zero mean. Q2_0 codes are drawn from
P(-1, 0, +1, +2) = (3, 3, 1, 1)/8, the zero-mean, unit-variance choice among eighths, so that its lone
+2 level does not bias the weights.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from strata.quant.formats import QType, block_size, qtype, type_size

# 12 random bits -> one Q2_0 code byte: 4 codes, each from 3 bits with P(code 0, 1, 2, 3) = (3, 3, 1, 1)/8
_C3 = np.array([0, 0, 0, 1, 1, 1, 2, 3], np.uint8)
_u = np.arange(4096)
_Q2_0_LUT = (_C3[_u & 7] | (_C3[(_u >> 3) & 7] << 2) | (_C3[(_u >> 6) & 7] << 4)
            | (_C3[(_u >> 9) & 7] << 6)).astype(np.uint8)
del _u


def _bytes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Uniform random uint8 of `shape`, from the generator's raw 64-bit output (much faster than rng.bytes)."""
    n = int(np.prod(shape))
    return rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n].reshape(shape)


def _f16(v: np.ndarray) -> np.ndarray:
    """float values (nb,) -> fp16 bytes (nb, 2)."""
    return np.ascontiguousarray(v, dtype=np.float32).astype(np.float16).view(np.uint8).reshape(-1, 2)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit scales and mins (nb, 8) -> the 12 bytes get_scale_min_k4 reads."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _centred_k(rng, nb, nsub, lo, hi, ratio, dmin_over_d):
    """Sub-scales in [lo, hi] and mins making d*sc*mean(q) = dmin*m (zero-mean sub-blocks)."""
    sc = rng.integers(lo, hi + 1, (nb, nsub)).astype(np.uint8)
    m = np.rint(sc * ratio / dmin_over_d).astype(np.uint8)
    return sc, m


def _blocks(qt: QType, nb: int, rng: np.random.Generator, d: np.ndarray) -> np.ndarray:
    """nb blocks with main scale d (float (nb,)); the unit-scale shape of each format is fixed here."""
    ts = type_size(qt)
    if qt == QType.Q2_0:
        b = np.empty((nb, ts), np.uint8)
        u = _bytes(rng, (nb, 32)).view(np.uint16) & np.uint16(0xFFF)
        b[:, 2:] = _Q2_0_LUT[u]
        b[:, :2] = _f16(d)
        return b
    b = _bytes(rng, (nb, ts))
    if qt in (QType.Q4_0, QType.Q5_0, QType.Q8_0, QType.IQ4_NL, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S,
              QType.IQ3_XXS, QType.IQ3_S, QType.IQ4_XS):
        b[:, :2] = _f16(d)
    elif qt in (QType.Q4_1, QType.Q5_1):
        b[:, :2] = _f16(d)
        b[:, 2:4] = _f16(-d * (7.5 if qt == QType.Q4_1 else 15.5))
    elif qt == QType.Q8_1:
        b[:, :2] = _f16(d)
        b[:, 2:4] = _f16(d * b[:, 4:].view(np.int8).sum(1))
    elif qt == QType.Q8_K:
        b[:, :4] = np.ascontiguousarray(d, dtype=np.float32).view(np.uint8).reshape(-1, 4)
        b[:, 260:] = b[:, 4:260].view(np.int8).reshape(nb, 16, 16).sum(2, dtype=np.int16).view(np.uint8)
    elif qt == QType.Q2_K:
        sc, m = _centred_k(rng, nb, 16, 4, 10, 1.5, 1.0)
        b[:, :16] = sc | (m << 4)
        b[:, 80:82] = _f16(d)
        b[:, 82:84] = _f16(d)
    elif qt == QType.Q3_K:
        b[:, 108:110] = _f16(d)
    elif qt in (QType.Q4_K, QType.Q5_K):
        ratio, dm = (7.5, 4.0) if qt == QType.Q4_K else (15.5, 8.0)
        sc, m = _centred_k(rng, nb, 8, 16, 32, ratio, dm)
        b[:, :2] = _f16(d)
        b[:, 2:4] = _f16(d * dm)
        b[:, 4:16] = _pack_k_scales(sc, m)
    elif qt == QType.Q6_K:
        b[:, 208:210] = _f16(d)
    else:
        raise ValueError(f"random_blocks: no generator for {qt.name}")
    return b


@lru_cache(maxsize=None)
def _unit_std(qt: QType) -> float:
    """Std of the dequantized values of blocks generated with d = 1 (measured once per format)."""
    from strata.quant.dequant import dequantize
    nb = max(64, 16384 // block_size(qt))
    raw = _blocks(qt, nb, np.random.default_rng(12345), np.ones(nb, np.float32))
    return float(dequantize(raw, qt).astype(np.float64).std())


def random_blocks(qt: int, shape_elems: tuple[int, ...], rng: np.random.Generator, scale: float) -> np.ndarray:
    """uint8 (*shape_elems[:-1], row_bytes) of valid random `qt` blocks, values of std ~ `scale`.

    Per block the main scale is jittered uniformly by +-25% around its target.
    """
    qt = qtype(qt)
    shape_elems = tuple(int(s) for s in shape_elems)
    n = shape_elems[-1]
    if qt in (QType.F32, QType.F16, QType.BF16):
        v = (rng.standard_normal(shape_elems, dtype=np.float32) * np.float32(scale))
        if qt == QType.F32:
            return v.view(np.uint8)
        if qt == QType.F16:
            return v.astype(np.float16).view(np.uint8)
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    bs = block_size(qt)
    if n % bs:
        raise ValueError(f"{qt.name} rows hold whole blocks of {bs}; {n} is not a multiple")
    nb = int(np.prod(shape_elems)) // bs
    d = (scale / _unit_std(qt)) * rng.uniform(0.75, 1.25, nb).astype(np.float32)
    raw = _blocks(qt, nb, rng, d)
    return raw.reshape(*shape_elems[:-1], n // bs * type_size(qt))

