"""The PLE hash constants, derived exactly as transformers' Qwen4-Exp does (splitmix64 multipliers, primes).

Files carry these constants; strata derives them only to write files (convert without them, make-model).
"""

from __future__ import annotations

import math

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_PRIME_1 = 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab: int, ngram: int, ple_layer_index: int, seed: int) -> list[int]:
    """Odd multipliers below (2^63 - 1) / vocab, so token * multiplier never overflows a signed 64-bit int."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    base = seed + _PRIME_1 * ple_layer_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half_bound) + 1 for i in range(ngram)]


def _is_prime(v: int) -> bool:
    if v < 2:
        return False
    if v % 2 == 0:
        return v == 2
    return all(v % d for d in range(3, math.isqrt(v) + 1, 2))


def head_vocab_sizes(base: int, n_heads: int, ple_layer_index: int = 0) -> list[int]:
    """Head h's table size: the (ple_layer_index * n_heads + h + 1)-th prime above base - 1."""
    sizes, p = [], base - 1
    for _ in range(ple_layer_index * n_heads):
        p += 1
        while not _is_prime(p):
            p += 1
    for _ in range(n_heads):
        p += 1
        while not _is_prime(p):
            p += 1
        sizes.append(p)
    return sizes


def head_offsets(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def padded_rows(sizes: list[int], divisor: int = 128) -> int:
    """Table rows as transformers allocates them: the total rounded up to a multiple of `divisor`."""
    return -(-sum(sizes) // divisor) * divisor
