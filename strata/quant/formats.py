"""ggml block formats: type ids, block geometry, the activation type each weight type is dotted against.

Block layouts (bytes, little-endian; d/dmin/m are IEEE fp16 unless noted) follow ggml-common.h:

    Q4_0   32 el  18 B  d, qs[16]                      v = (nibble - 8) * d; low nibbles are el 0..15
    Q4_1   32 el  20 B  d, m, qs[16]                   v = nibble * d + m
    Q5_0   32 el  22 B  d, qh[4], qs[16]               v = ((nibble | bit << 4) - 16) * d
    Q5_1   32 el  24 B  d, m, qh[4], qs[16]            v = (nibble | bit << 4) * d + m
    Q8_0   32 el  34 B  d, qs[32] int8                 v = q * d
    Q8_1   32 el  36 B  d, s = fp16(d * sum q), qs[32] activation-only (gguf lists a stale 40 B size)
    Q2_0   64 el  18 B  d, qs[16]                      v = (code - 1) * d; el j at bits 2*(j%4) of byte j/4
    Q2_K  256 el  84 B  scales[16] (4b sc | 4b min), qs[64], d, dmin
    Q3_K  256 el 110 B  hmask[32], qs[64], scales[12] (6b), d
    Q4_K  256 el 144 B  d, dmin, scales[12] (6b sc/min), qs[128]
    Q5_K  256 el 176 B  d, dmin, scales[12], qh[32], qs[128]
    Q6_K  256 el 210 B  ql[128], qh[64], scales[16] int8, d
    Q8_K  256 el 292 B  d (fp32), qs[256] int8, bsums[16] int16   activation-only
    IQ2_XXS 256 el 66 B  d, qs[32] uint16 (8 x (4 grid bytes, 4x7 sign bits + 4b scale))
    IQ2_XS  256 el 74 B  d, qs[32] uint16 (9b grid | 7b signs), scales[8]
    IQ2_S   256 el 82 B  d, qs[32], signs[32], qh[8], scales[8]
    IQ3_XXS 256 el 98 B  d, qs[64] grid bytes, 8 x uint32 (4x7 sign bits + 4b scale)
    IQ3_S   256 el 110 B d, qs[64], qh[8], signs[32], scales[4]
    IQ4_NL  32 el  18 B  d, qs[16]                     v = kvalues_iq4nl[nibble] * d
    IQ4_XS 256 el 136 B  d, scales_h (uint16), scales_l[4], qs[128]
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np


class QType(IntEnum):
    """ggml_type ids as stored in GGUF tensor infos."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    BF16 = 30
    Q2_0 = 42


QK_K = 256

# (elements per block, bytes per block), from ggml-common.h's static_asserts
_GEOMETRY: dict[QType, tuple[int, int]] = {
    QType.F32: (1, 4),
    QType.F16: (1, 2),
    QType.BF16: (1, 2),
    QType.Q4_0: (32, 18),
    QType.Q4_1: (32, 20),
    QType.Q5_0: (32, 22),
    QType.Q5_1: (32, 24),
    QType.Q8_0: (32, 34),
    QType.Q8_1: (32, 36),
    QType.Q2_0: (64, 18),
    QType.Q2_K: (QK_K, 84),
    QType.Q3_K: (QK_K, 110),
    QType.Q4_K: (QK_K, 144),
    QType.Q5_K: (QK_K, 176),
    QType.Q6_K: (QK_K, 210),
    QType.Q8_K: (QK_K, 292),
    QType.IQ2_XXS: (QK_K, 66),
    QType.IQ2_XS: (QK_K, 74),
    QType.IQ2_S: (QK_K, 82),
    QType.IQ3_XXS: (QK_K, 98),
    QType.IQ3_S: (QK_K, 110),
    QType.IQ4_NL: (32, 18),
    QType.IQ4_XS: (QK_K, 136),
}

FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)

# vec_dot_type of ggml-cpu.c's type_traits_cpu: the format the activation row is converted to (once per
# matmul, by that type's from_float) before the weight type's vec_dot runs against it.
ACT_TYPE: dict[QType, QType] = {
    QType.F32: QType.F32,         # ggml_vec_dot_f32
    QType.F16: QType.F16,         # x -> fp16 (ggml_cpu_fp32_to_fp16), ggml_vec_dot_f16
    QType.BF16: QType.BF16,       # x -> bf16 (round to nearest even), ggml_vec_dot_bf16
    QType.Q4_0: QType.Q8_0,       # ggml_vec_dot_q4_0_q8_0
    QType.Q4_1: QType.Q8_1,       # ggml_vec_dot_q4_1_q8_1: needs Q8_1's s = fp16(d * sum q) for the min term
    QType.Q5_0: QType.Q8_0,       # ggml_vec_dot_q5_0_q8_0
    QType.Q5_1: QType.Q8_1,       # ggml_vec_dot_q5_1_q8_1
    QType.Q8_0: QType.Q8_0,       # ggml_vec_dot_q8_0_q8_0
    QType.Q2_0: QType.Q8_0,       # ggml_vec_dot_q2_0_q8_0: one Q2_0 block spans two Q8_0 blocks
    QType.IQ4_NL: QType.Q8_0,     # ggml_vec_dot_iq4_nl_q8_0
    QType.Q2_K: QType.Q8_K,       # ggml_vec_dot_q2_K_q8_K (uses bsums for the mins)
    QType.Q3_K: QType.Q8_K,
    QType.Q4_K: QType.Q8_K,       # uses bsums for the mins
    QType.Q5_K: QType.Q8_K,       # uses bsums for the mins
    QType.Q6_K: QType.Q8_K,
    QType.IQ2_XXS: QType.Q8_K,
    QType.IQ2_XS: QType.Q8_K,
    QType.IQ2_S: QType.Q8_K,
    QType.IQ3_XXS: QType.Q8_K,
    QType.IQ3_S: QType.Q8_K,
    QType.IQ4_XS: QType.Q8_K,     # ggml_vec_dot_iq4_xs_q8_K
}

# kvalues_iq4nl (ggml-common.h): the 16 levels of IQ4_NL / IQ4_XS
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)

# every fp16 bit pattern -> float32, exact (numpy's conversion keeps NaN payloads, as gguf's dequantize does)
F16_TO_F32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def readonly(a: np.ndarray) -> np.ndarray:
    """`a` as a read-only view: kernels then see one array type whether the data is a file mapping
    (read-only) or a fresh array, so numba compiles one specialization instead of two."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


_BY_ID = {int(q): q for q in QType}


def qtype(qt: int) -> QType:
    """`qt` as a QType (cheap: this sits on every matvec call); ValueError when strata has no such format."""
    if type(qt) is QType:
        return qt
    try:
        return _BY_ID[int(qt)]
    except KeyError:
        raise ValueError(f"unsupported ggml type id {int(qt)}") from None


def block_size(qt: int) -> int:
    """Elements per block."""
    return _GEOMETRY[qtype(qt)][0]


def type_size(qt: int) -> int:
    """Bytes per block."""
    return _GEOMETRY[qtype(qt)][1]


def row_bytes(qt: int, n: int) -> int:
    """Bytes of a row of `n` elements; ValueError when n is not a whole number of blocks."""
    bs, ts = _GEOMETRY[qtype(qt)]
    if n % bs != 0:
        raise ValueError(f"a {QType(qt).name} row holds whole blocks of {bs} elements; {n} is not a multiple")
    return n // bs * ts
