"""IEEE fp16 <-> float32 inside numba code (numba has no float16 type on the CPU).

Both directions match numpy's astype bit for bit (round to nearest even; NaN payloads kept, the top
mantissa bits, as numpy does). The kernels that only read fp16 scales use formats.F16_TO_F32 instead.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_JIT = dict(nogil=True, cache=True, fastmath=False)
_MAGIC = np.float32(12582912.0)   # (v + M) - M rounds |v| < 2^22 to the nearest integer, ties to even


@njit(**_JIT)
def f16_encode(a, h):
    """a: float32 (k,) -> h: uint16 (k,) fp16 bits."""
    u = a.view(np.uint32)
    for i in range(u.shape[0]):
        m = u[i] & np.uint32(0x7FFFFFFF)
        sign = np.uint16((u[i] >> np.uint32(16)) & np.uint32(0x8000))
        if m > np.uint32(0x7F800000):                          # NaN: keep the payload's top 10 bits, nonzero
            h[i] = sign | np.uint16(0x7C00) | np.uint16(max(np.uint32(1), (m & np.uint32(0x7FFFFF)) >> np.uint32(13)))
        elif m >= np.uint32(0x477FF000):                       # >= 65520 (or inf) -> inf
            h[i] = sign | np.uint16(0x7C00)
        elif m >= np.uint32(0x38800000):                       # normal: drop 13 mantissa bits, ties to even
            m = m + np.uint32(0xFFF) + ((m >> np.uint32(13)) & np.uint32(1))
            h[i] = sign | np.uint16((m - np.uint32(0x38000000)) >> np.uint32(13))
        else:                                                  # subnormal: a multiple of 2^-24
            v = abs(a[i]) * np.float32(16777216.0)
            h[i] = sign | np.uint16(np.int64((v + _MAGIC) - _MAGIC))


@njit(**_JIT)
def f16_decode(h, a):
    """h: uint16 (k,) fp16 bits -> a: float32 (k,)."""
    u = a.view(np.uint32)
    for i in range(h.shape[0]):
        e = (np.uint32(h[i]) >> np.uint32(10)) & np.uint32(31)
        mant = np.uint32(h[i]) & np.uint32(0x3FF)
        sign = (np.uint32(h[i]) & np.uint32(0x8000)) << np.uint32(16)
        if e == 31:
            u[i] = sign | np.uint32(0x7F800000) | (mant << np.uint32(13))
        elif e == 0:
            v = np.float32(mant) * np.float32(1.0 / 16777216.0)
            a[i] = -v if sign else v
        else:
            u[i] = sign | ((e + np.uint32(112)) << np.uint32(23)) | (mant << np.uint32(13))


@njit(**_JIT)
def f16_round(a):
    """Round float32 values in place to the nearest fp16 value."""
    h = np.empty(a.shape[0], np.uint16)
    f16_encode(a, h)
    f16_decode(h, a)
