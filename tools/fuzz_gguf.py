"""A seeded fuzzer of malformed GGUF files: mutations of the `tiny` model, each run through `cli.py logits`, each
run classified.

    python tools/fuzz_gguf.py --cases 5000 [--seed 0] [--jobs 2] [--timeout 60] [--exec] [--keep DIR]
    python tools/fuzz_gguf.py --case 1234 [--seed 0]       # one case again: its mutation and what the CLI said

Mutations (one per case, sometimes two or three): truncation, byte flips in the header / metadata / tensor table,
the key and tensor counts, tensor data offsets, types and shapes (with the data laid out again or not), duplicated
keys and tensors, general.alignment values and types, NaN and inf written into tensor data, metadata values set to
0, negative, huge, NaN or inf, a value's kind changed (a scalar stored as an array and the reverse), keys and tensors
dropped, tensors with overflowing shapes added, strings made invalid. The bases are `tiny` in three type mixes.

Outcomes: error (exit 2, one `error:` line, no traceback) and ok (exit 0, every logit finite) keep the CLI's
promise; traceback, crash (killed by a signal), hang (past --timeout), nan-output (exit 0 with a non-finite
logit) and other (any other exit status, or not exactly one `error:` line) break it, and make this exit 1.
Each case runs in a child forked from this process after strata is imported and warm (~50 ms a case, crash-
and hang-isolated); --exec runs a fresh `python cli.py` per case instead (~1.5 s a case).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import math
import os
import random
import resource
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if __name__ == "__main__":
    # numba's default threading layer here is GNU OpenMP, which aborts a child forked after it ran; workqueue does
    # not (set before numba is imported; an importer, such as the tests, keeps its own)
    os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

import numpy as np  # noqa: E402  (after the path line: runs from a checkout)
from gguf import GGUF_MAGIC, GGUFValueType as VT  # noqa: E402

from strata.model.gguf_file import GGUFFile  # noqa: E402
from strata.model.gguf_writer import _value  # noqa: E402
from strata.quant import QType, block_size, type_size  # noqa: E402

TOKENS = ",".join(str((7 * i * i + 3 * i + 1) % 512) for i in range(24))   # past the QSA budget: blocks selected
GOOD = ("error", "ok")
BAD = ("traceback", "crash", "hang", "nan-output", "other")
MIXES = ("f32", "q8_0", "bf16")


# ---- a GGUF as editable parts ----------------------------------------------------------------------------------
@dataclass
class KV:
    key: bytes
    vtype: int
    value: bytes               # the serialized value, after the type field


@dataclass
class Info:
    name: bytes
    dims: list[int]
    qtype: int
    offset: int                # relative to the data section


@dataclass
class Gguf:
    """A GGUF's parts, written back by to_bytes(); anything may be set to what no valid file holds."""
    kvs: list[KV]
    infos: list[Info]
    data: bytearray            # the data section
    align: int = 32            # where to_bytes puts the data section (general.alignment may claim another)
    magic: int = GGUF_MAGIC
    version: int = 3
    n_kv: int | None = None    # the header's counts; None: the real ones
    n_tensors: int | None = None

    @classmethod
    def read(cls, path: Path) -> "Gguf":
        gf = GGUFFile(path)
        kvs = []
        for k, v in gf.metadata.items():
            vt, sub = gf.value_types[k]
            kvs.append(KV(k.encode(), int(vt), _value(vt, v, sub)))
        infos = [Info(t.name.encode(), list(t.shape), int(t.qtype), t.offset - gf.data_offset)
                 for t in gf.tensors.values()]
        return cls(kvs, infos, bytearray(Path(path).read_bytes()[gf.data_offset:]), gf.alignment)

    def header(self) -> bytes:
        out = [struct.pack("<IIQQ", self.magic, self.version,
                           len(self.infos) if self.n_tensors is None else self.n_tensors,
                           len(self.kvs) if self.n_kv is None else self.n_kv)]
        out += [_str(kv.key) + struct.pack("<I", kv.vtype) + kv.value for kv in self.kvs]
        for t in self.infos:
            out.append(_str(t.name) + struct.pack("<I", len(t.dims)) + b"".join(struct.pack("<Q", d) for d in t.dims)
                       + struct.pack("<IQ", t.qtype, t.offset))
        return b"".join(out)

    def to_bytes(self) -> bytes:
        head = self.header()
        return head + b"\0" * (_pad(len(head), self.align) - len(head)) + bytes(self.data)

    def kv(self, key: str) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key.encode()), None)

    def set(self, key: str, vtype: int, value, sub: int | None = None) -> None:
        raw = _value(VT(vtype), value, None if sub is None else VT(sub))
        kv = self.kv(key)
        if kv is None:
            self.kvs.append(KV(key.encode(), vtype, raw))
        else:
            kv.vtype, kv.value = vtype, raw

    def nbytes(self, t: Info) -> int:
        n = math.prod(t.dims)
        qt = QType(t.qtype)
        return n // block_size(qt) * type_size(qt)

    def relayout(self, align: int | None = None) -> None:
        """Lay the data out again as a valid writer would, at `align`: each tensor's bytes its declared size (its
        old bytes cut, or grown with random ones). ValueError for a size too big to write."""
        align = align or self.align
        rng = random.Random(len(self.data))
        chunks, at = [], 0
        for t in self.infos:
            n = self.nbytes(t)
            if n > 1 << 26:
                raise ValueError(f"{n} bytes is too big to lay out")
            old = bytes(self.data[t.offset:t.offset + n])
            t.offset = at
            chunks.append(old + rng.randbytes(n - len(old)) + b"\0" * (_pad(n, align) - n))
            at += _pad(n, align)
        self.data = bytearray(b"".join(chunks))
        self.align = align


def _str(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _pad(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# ---- mutations: each edits g (or returns new bytes) and says what it did ---------------------------------------
QTYPES = [int(t) for t in QType]
BAD_TYPE_IDS = [4, 5, 19, 24, 29, 31, 39, 41, 43, 99, 1 << 31, (1 << 32) - 1]
BIG = [1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
_FMT = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
        VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT32: "<f", VT.FLOAT64: "<d", VT.BOOL: "<?"}


def _fits(vt: VT, v) -> bool:
    if vt in (VT.FLOAT32, VT.FLOAT64):
        return True
    if isinstance(v, float):
        return False
    bits = struct.calcsize(_FMT[vt]) * 8
    signed = _FMT[vt].islower()
    return (-(1 << bits - 1) <= v < 1 << bits - 1) if signed else 0 <= v < 1 << bits


def _int_type_for(v, rng) -> VT:
    for vt in rng.sample([VT.UINT32, VT.INT32, VT.UINT64, VT.INT64], 4):
        if _fits(vt, v):
            return vt
    return VT.UINT64


def _decode(kv: KV):
    """(value, element type) of a scalar or an array of scalars; None for strings and string arrays."""
    vt = VT(kv.vtype)
    if vt in _FMT:
        return struct.unpack(_FMT[vt], kv.value[:struct.calcsize(_FMT[vt])])[0], None
    if vt == VT.ARRAY:
        et, n = struct.unpack("<IQ", kv.value[:12])
        if VT(et) in _FMT:
            w = struct.calcsize(_FMT[VT(et)])
            return [struct.unpack(_FMT[VT(et)], kv.value[12 + i * w:12 + (i + 1) * w])[0] for i in range(n)], VT(et)
    return None


def _new_number(v, rng):
    base = v if isinstance(v, (int, float)) and not isinstance(v, bool) else 1
    return rng.choice([0, 1, -1, 2, -2, 3, base + 1, base - 1, base * 2, int(base) // 2, *BIG, -(1 << 31),
                       math.nan, math.inf, -math.inf, 1e-45, 1e38, -0.0, 0.5, 1e-3])


def m_value(g: Gguf, rng) -> str:
    """A number (or an array element) of the metadata: 0, +-1, off by one, doubled, huge, NaN, inf..."""
    cands = [kv for kv in g.kvs if _decode(kv) is not None and kv.key != b"tokenizer.ggml.token_type"]
    kv = rng.choice(cands)
    v, et = _decode(kv)
    key = kv.key.decode()
    if et is None:
        new = _new_number(v, rng)
        vt = VT(kv.vtype) if _fits(VT(kv.vtype), new) else \
            (rng.choice([VT.FLOAT32, VT.FLOAT64]) if isinstance(new, float) else _int_type_for(new, rng))
        if vt == VT.FLOAT32 and isinstance(new, int) and abs(new) > 3e38:
            vt = VT.FLOAT64
        g.set(key, vt, float(new) if vt in (VT.FLOAT32, VT.FLOAT64) else new)
        return f"value {key} = {new!r} ({vt.name})"
    arr = list(v)
    op = rng.choice(["elem", "elem", "append", "drop", "empty"])
    if op == "elem" and arr:
        i = rng.randrange(len(arr))
        arr[i] = _new_number(arr[i], rng)
    elif op == "append":
        arr.append(arr[-1] if arr and rng.random() < 0.5 else _new_number(0, rng))
    elif op == "drop" and arr:
        arr.pop(rng.randrange(len(arr)))
    else:
        arr = []
    if et == VT.BOOL:
        arr = [bool(x) if not isinstance(x, float) or math.isfinite(x) else True for x in arr]
    elif any(isinstance(x, float) for x in arr) and et not in (VT.FLOAT32, VT.FLOAT64):
        et = VT.FLOAT64
    elif et not in (VT.FLOAT32, VT.FLOAT64) and not all(_fits(et, x) for x in arr):
        et = next((t for t in (VT.INT64, VT.UINT64) if all(_fits(t, x) for x in arr)), VT.FLOAT64)
    if et in (VT.FLOAT32, VT.FLOAT64):
        arr = [float(x) for x in arr]
        if et == VT.FLOAT32 and any(math.isfinite(x) and abs(x) > 3e38 for x in arr):
            et = VT.FLOAT64
    g.set(key, VT.ARRAY, arr, et)
    return f"array {key} {op} -> {arr[:6]}{'...' if len(arr) > 6 else ''} ({et.name})"


def m_kind(g: Gguf, rng) -> str:
    """A key's kind changed: a scalar stored as an array of one, an array as its first element, a string, a bool,
    a float, an array of arrays."""
    kv = rng.choice(g.kvs)
    key = kv.key.decode(errors="replace")
    d = _decode(kv)
    op = rng.choice(["to-array", "to-scalar", "string", "bool", "float", "nested"])
    if op == "to-array" and d is not None and d[1] is None:
        kv.value = struct.pack("<IQ", kv.vtype, 1) + kv.value
        kv.vtype = VT.ARRAY
    elif op == "to-scalar" and d is not None and d[1] is not None and d[0]:
        kv.vtype, kv.value = d[1], _value(d[1], d[0][0])
    elif op == "string":
        kv.vtype, kv.value = VT.STRING, _str(b"7")
    elif op == "bool":
        kv.vtype, kv.value = VT.BOOL, b"\x01"
    elif op == "float":
        kv.vtype, kv.value = VT.FLOAT32, struct.pack("<f", 1.5)
    else:
        op = "nested"
        kv.vtype, kv.value = VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 1) + struct.pack("<IQ", VT.UINT32, 1) + \
            struct.pack("<I", 4)
    return f"kind {key} -> {op}"


def m_dup_key(g: Gguf, rng) -> str:
    """A key twice: the same value, or (numbers) another one, before or after the first."""
    kv = rng.choice(g.kvs)
    dup = copy.deepcopy(kv)
    d = _decode(kv)
    if d is not None and d[1] is None and rng.random() < 0.7:
        v = d[0]
        new = v + 1 if not isinstance(v, float) else v * 2
        if _fits(VT(kv.vtype), new):
            dup.value = _value(VT(kv.vtype), new)
    at = rng.randrange(len(g.kvs) + 1)
    g.kvs.insert(at, dup)
    return f"duplicate key {kv.key.decode(errors='replace')} at #{at}"


def m_drop_key(g: Gguf, rng) -> str:
    kv = g.kvs.pop(rng.randrange(len(g.kvs)))
    return f"drop key {kv.key.decode(errors='replace')}"


def m_alignment(g: Gguf, rng) -> str:
    """general.alignment: a value (powers of two or not, 0, huge), a type; the data laid out for it, or not."""
    a = rng.choice([0, 1, 2, 3, 4, 8, 16, 24, 31, 33, 48, 64, 128, 256, 4096, 65536, 1 << 31, (1 << 32) - 1])
    vt = rng.choice([VT.UINT32] * 6 + [VT.UINT64, VT.INT32, VT.UINT8, VT.UINT16])
    if not _fits(vt, a):
        vt = VT.UINT32 if a < 1 << 32 else VT.UINT64
    g.set("general.alignment", vt, a)
    laid = a > 0 and a & (a - 1) == 0 and a <= 65536 and rng.random() < 0.4
    if laid:
        g.relayout(align=a)
    return f"general.alignment = {a} ({vt.name}){', data laid out for it' if laid else ''}"


def _tensor(g: Gguf, rng) -> tuple[int, Info]:
    i = rng.randrange(len(g.infos))
    return i, g.infos[i]


def m_offset(g: Gguf, rng) -> str:
    """A tensor's data offset: misaligned, shifted by an alignment (overlap or gap), another tensor's, 0, huge."""
    i, t = _tensor(g, rng)
    other = g.infos[(i + rng.choice([-1, 1])) % len(g.infos)].offset
    t.offset = rng.choice([t.offset + 1, t.offset + 16, t.offset + g.align, max(0, t.offset - g.align), other, 0,
                           rng.randrange(len(g.data) + 1), len(g.data), *BIG[3:]])
    return f"offset of {t.name.decode()} -> {t.offset}"


def m_swap(g: Gguf, rng) -> str:
    """Two tensors' offsets swapped, or two table entries reordered (their data left where it is)."""
    i, j = rng.sample(range(len(g.infos)), 2)
    a, b = g.infos[i], g.infos[j]
    if rng.random() < 0.5:
        a.offset, b.offset = b.offset, a.offset
        return f"swap offsets of {a.name.decode()} and {b.name.decode()}"
    g.infos[i], g.infos[j] = b, a
    return f"swap table entries {a.name.decode()} and {b.name.decode()}"


def m_type(g: Gguf, rng) -> str:
    """A tensor's ggml type: one of the same block size (its rows still whole), any type, Q8_1/Q8_K, an id ggml
    does not have; the data laid out for the new size, or not."""
    i, t = _tensor(g, rng)
    old = QType(t.qtype)
    same = [q for q in QTYPES if q != t.qtype and t.dims[0] % block_size(QType(q)) == 0]
    t.qtype = rng.choice([rng.choice(same or QTYPES), rng.choice(QTYPES), rng.choice([9, 15]),
                          rng.choice(BAD_TYPE_IDS)])
    laid = t.qtype in QTYPES and t.dims[0] % block_size(QType(t.qtype)) == 0 and rng.random() < 0.6
    if laid:
        g.relayout()
    new = QType(t.qtype).name if t.qtype in QTYPES else str(t.qtype)
    return f"type of {t.name.decode()} {old.name} -> {new}{', data laid out' if laid else ''}"


def m_shape(g: Gguf, rng) -> str:
    """A tensor's dimension changed (doubled, halved, +1, 0, 1, huge), a dimension added or dropped; the data laid
    out for it, or not."""
    i, t = _tensor(g, rng)
    old = list(t.dims)
    op = rng.choice(["dim", "dim", "dim", "add", "drop", "swap"])
    if op == "add":
        t.dims.append(rng.choice([1, 2, 0]))
    elif op == "drop" and len(t.dims) > 1:
        t.dims.pop()
    elif op == "swap" and len(t.dims) > 1:
        t.dims[0], t.dims[1] = t.dims[1], t.dims[0]
    else:
        k = rng.randrange(len(t.dims))
        d = t.dims[k]
        t.dims[k] = rng.choice([d * 2, d // 2, d + 1, max(0, d - 1), 0, 1, *BIG])
    laid = t.dims[0] % block_size(QType(t.qtype)) == 0 and rng.random() < 0.6
    if laid:
        g.relayout()
    return f"shape of {t.name.decode()} {old} -> {t.dims}{', data laid out' if laid else ''}"


def m_dup_tensor(g: Gguf, rng) -> str:
    """A tensor twice in the table: pointing at the same data, or with a copy of it appended."""
    i, t = _tensor(g, rng)
    dup = copy.deepcopy(t)
    if rng.random() < 0.5:
        g.infos.insert(i + 1, dup)
        return f"duplicate tensor {t.name.decode()} (same data)"
    n = g.nbytes(t)
    dup.offset = len(g.data)
    g.data += g.data[t.offset:t.offset + n] + b"\0" * (_pad(n, g.align) - n)
    g.infos.append(dup)
    return f"duplicate tensor {t.name.decode()} (data appended)"


def m_drop_tensor(g: Gguf, rng) -> str:
    i, t = _tensor(g, rng)
    del g.infos[i]
    if rng.random() < 0.5:
        g.relayout()
        return f"drop tensor {t.name.decode()} and its data"
    return f"drop tensor {t.name.decode()} from the table"


def m_extra_tensor(g: Gguf, rng) -> str:
    """An extra tensor whose shape overflows int64 or the file, or a small valid one."""
    dims = rng.choice([[1 << 32, 1 << 32, 1 << 32], [1 << 63, 2], [(1 << 64) - 1], [1 << 40], [1 << 21, 1 << 21],
                       [4, 4]])
    qt = rng.choice([QType.F32, QType.F16, QType.Q8_0 if dims[0] % 32 == 0 else QType.F32])
    g.infos.append(Info(f"extra.{rng.randrange(100)}.weight".encode(), dims, int(qt), len(g.data)))
    n = min(math.prod(dims) // block_size(qt) * type_size(qt), 1 << 16)
    g.data += b"\0" * _pad(n, g.align)
    return f"extra tensor {dims} {qt.name}"


def m_string(g: Gguf, rng) -> str:
    """A key or tensor name renamed, made invalid UTF-8 or 64+ bytes long; a string value changed."""
    op = rng.choice(["key", "key-utf8", "name", "name-utf8", "name-long", "name-dup", "value", "token"])
    if op.startswith("key"):
        kv = rng.choice(g.kvs)
        old = kv.key
        if op == "key":
            b = bytearray(kv.key)
            b[rng.randrange(len(b))] = rng.randrange(0x20, 0x7f)
            kv.key = bytes(b)
        else:
            kv.key = kv.key[:3] + b"\xff\xfe" + kv.key[3:]
        return f"{op} {old.decode(errors='replace')} -> {kv.key!r}"
    if op.startswith("name"):
        i, t = _tensor(g, rng)
        old = t.name
        t.name = {"name": old.replace(b".", b"_", 1), "name-utf8": b"\xc3" + old, "name-long": old + b"x" * 64,
                  "name-dup": g.infos[(i + 1) % len(g.infos)].name}[op]
        return f"{op} {old.decode()} -> {t.name[:80]!r}"
    if op == "value":
        kv = rng.choice([kv for kv in g.kvs if kv.vtype == VT.STRING])
        kv.value = _str(rng.choice([b"", b"llama", b"\xff\xfe", b"qwen4exp\x00", b"gpt2", rng.randbytes(8)]))
        return f"string {kv.key.decode()} -> {kv.value[8:]!r}"
    kv = g.kv("tokenizer.ggml.tokens")
    et, n = struct.unpack("<IQ", kv.value[:12])
    k = rng.randrange(1, min(n, 3) + 1)
    kv.value = struct.pack("<IQ", et, n + rng.choice([-k, k])) + kv.value[12:]
    return f"tokens count {n} -> {n + k}"


def m_counts(g: Gguf, rng) -> str:
    """The header's key or tensor count off by a little, 0, or huge."""
    which = rng.choice(["n_kv", "n_tensors"])
    real = len(g.kvs) if which == "n_kv" else len(g.infos)
    v = rng.choice([real + 1, real - 1, real + 2, real - 3, 0, 1, *BIG])
    setattr(g, which, max(0, v))
    return f"{which} {real} -> {max(0, v)}"


def m_header(g: Gguf, rng) -> str:
    op = rng.choice(["magic", "version"])
    if op == "magic":
        g.magic = rng.choice([0, GGUF_MAGIC ^ 1, 0x47475546])     # 0x47475546: byte-swapped
        return f"magic -> {g.magic:#x}"
    g.version = rng.choice([0, 1, 2, 4, 99, (1 << 32) - 1])
    return f"version -> {g.version}"


def m_nan(g: Gguf, rng) -> str:
    """NaN or inf written into a tensor's values: F32/F16/BF16 elements, or a quantized block's f16 scale."""
    i, t = _tensor(g, rng)
    qt = QType(t.qtype)
    n = g.nbytes(t)
    val = rng.choice(["nan", "inf", "-inf"])
    k = rng.choice([1, 1, 3, 100])
    if qt in (QType.F32, QType.F16, QType.BF16):
        w = type_size(qt)
        pat = {QType.F32: struct.pack("<f", float(val)),
               QType.F16: struct.pack("<e", float(val)),
               QType.BF16: struct.pack("<f", float(val))[2:]}[qt]
        for _ in range(k):
            at = t.offset + rng.randrange(n // w) * w
            g.data[at:at + w] = pat
        return f"{val} x{k} into {t.name.decode()} ({qt.name})"
    ts = type_size(qt)
    for _ in range(k):
        at = t.offset + rng.randrange(n // ts) * ts          # a block's first bytes: its f16 scale in Q8_0 / Q4_0...
        g.data[at:at + 2] = struct.pack("<e", float(val))
    return f"{val} x{k} into block scales of {t.name.decode()} ({qt.name})"


STRUCTURE = [m_value, m_value, m_value, m_kind, m_dup_key, m_drop_key, m_alignment, m_offset, m_swap, m_type,
             m_type, m_shape, m_shape, m_dup_tensor, m_drop_tensor, m_extra_tensor, m_string, m_counts, m_header,
             m_nan, m_nan, m_nan]


def mutate(base: Gguf, rng: random.Random) -> tuple[str, str, bytes]:
    """(kind, description, file bytes) of one case."""
    r = rng.random()
    if r < 0.12:                                  # truncation: anywhere, often in the header or the last pages
        blob = base.to_bytes()
        head = len(base.header())
        cut = rng.choice([rng.randrange(head + 64), rng.randrange(len(blob)), len(blob) - rng.randrange(1, 8192)])
        return "truncate", f"truncate at {cut} of {len(blob)}", blob[:max(0, cut)]
    if r < 0.24:                                  # byte flips in the header, metadata and tensor table
        blob = bytearray(base.to_bytes())
        head = len(base.header())
        k = rng.choice([1, 1, 2, 4, 8])
        at = sorted(rng.randrange(head) for _ in range(k))
        for a in at:
            blob[a] ^= rng.randrange(1, 256)
        return "flip", f"flip {k} bytes at {at}", bytes(blob)
    g = copy.deepcopy(base)
    n = 1 if rng.random() < 0.85 else rng.choice([2, 3])
    fns = [rng.choice(STRUCTURE) for _ in range(n)]
    notes = []
    for fn in fns:
        try:
            notes.append(fn(g, rng))
        except (IndexError, ValueError, KeyError, struct.error, OverflowError) as e:  # not applicable to this g
            notes.append(f"{fn.__name__} skipped ({type(e).__name__})")
    kind = fns[0].__name__[2:] if n == 1 else "combined"
    try:
        blob = g.to_bytes()
    except (struct.error, OverflowError, ValueError) as e:      # a value no GGUF field can hold: write it raw
        return kind, "; ".join(notes) + f" (unwritable: {e})", base.to_bytes()
    return kind, "; ".join(notes), blob


# ---- running a case and classifying it -------------------------------------------------------------------------
def classify(rc: int | None, stderr: str, out: Path) -> str:
    if rc is None:
        return "hang"
    if rc < 0:
        return "crash"
    if "Traceback (most recent call last)" in stderr:
        return "traceback"
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    if rc == 2 and len(errors) == 1 and stderr.rstrip().splitlines()[-1].startswith("error:"):
        return "error"
    if rc == 0 and not errors:
        try:
            logits = np.load(out)
        except (OSError, ValueError):
            return "other"
        return "ok" if np.isfinite(logits).all() else "nan-output"
    return "other"


def argv_for(path: Path, out: Path) -> list[str]:
    return ["logits", str(path), "--tokens", TOKENS, "--out", str(out)]


def run_inprocess(path: Path, out: Path) -> tuple[str, str]:
    """(outcome, stderr) of cli.main in this process: an exception escaping it is a traceback outcome."""
    import cli
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = cli.main(argv_for(path, out))
        except Exception:
            traceback.print_exc(file=err)
            rc = 1
    return classify(rc, err.getvalue(), out), err.getvalue()


def _cache() -> Path:
    return Path(os.environ.get("STRATA_CACHE", Path.home() / ".cache" / "strata")) / "fuzz"


def bases(cache: Path) -> dict[str, Gguf]:
    """The tiny model in each mix, made once into `cache`."""
    from strata.model.synth import make_model
    cache.mkdir(parents=True, exist_ok=True)
    out = {}
    for mix in MIXES:
        p = cache / f"tiny-{mix}.gguf"
        if not p.exists():
            make_model("tiny", p, seed=0, mix=mix, log=lambda s: None)
        out[mix] = Gguf.read(p)
    return out


def case(bases_: dict[str, Gguf], seed: int, i: int) -> tuple[str, str, str, bytes]:
    """(base mix, kind, description, bytes) of case i: the same for the same (seed, i) on every machine."""
    rng = random.Random(f"{seed}:{i}")
    mix = rng.choice(MIXES)
    return (mix, *mutate(bases_[mix], rng))


@dataclass
class _Running:
    i: int
    pid: int | None
    proc: subprocess.Popen | None
    t0: float
    path: Path
    out: Path
    err: Path
    kind: str
    what: str


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    by_kind: dict = field(default_factory=lambda: defaultdict(Counter))
    broken: list = field(default_factory=list)

    def add(self, i: int, kind: str, what: str, outcome: str, stderr: str) -> None:
        self.counts[outcome] += 1
        self.by_kind[kind][outcome] += 1
        if outcome in BAD:
            self.broken.append((i, kind, what, outcome, stderr.strip().splitlines()[-3:]))


def _fork(argv: list[str], err: Path) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    rc = 1
    try:
        fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        resource.setrlimit(resource.RLIMIT_AS, (_memory_limit(), resource.RLIM_INFINITY))
        import cli
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(rc)


def _memory_limit() -> int:
    """This process's address space plus 2 GiB: a case that tries to allocate more fails (MemoryError is then
    a traceback outcome) instead of swapping the machine."""
    with open("/proc/self/status") as f:
        vm = next(int(ln.split()[1]) for ln in f if ln.startswith("VmSize:"))
    return vm * 1024 + (2 << 30)


def run(n_cases: int, seed: int, jobs: int, timeout: float, fresh: bool, keep: Path | None,
        log=print) -> Tally:
    tally = Tally()
    with tempfile.TemporaryDirectory(prefix="strata-fuzz-") as tmp:
        tmp = Path(tmp)
        cache = _cache()
        bs = bases(cache)
        if not fresh:                         # warm: numba kernels loaded, strata imported, before any fork
            run_inprocess(cache / "tiny-f32.gguf", tmp / "warm.npy")
            run_inprocess(cache / "tiny-q8_0.gguf", tmp / "warm.npy")
            run_inprocess(cache / "tiny-bf16.gguf", tmp / "warm.npy")
        running: list[_Running] = []
        nxt, done, t_start = 0, 0, time.time()
        while done < n_cases:
            while nxt < n_cases and len(running) < jobs:
                mix, kind, what, blob = case(bs, seed, nxt)
                slot = tmp / f"c{nxt}"
                path, out, err = slot.with_suffix(".gguf"), slot.with_suffix(".npy"), slot.with_suffix(".err")
                path.write_bytes(blob)
                out.unlink(missing_ok=True)
                if fresh:
                    with open(err, "wb") as ef:
                        proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), *argv_for(path, out)],
                                                stdout=subprocess.DEVNULL, stderr=ef)
                    running.append(_Running(nxt, None, proc, time.time(), path, out, err, kind, f"[{mix}] {what}"))
                else:
                    running.append(_Running(nxt, _fork(argv_for(path, out), err), None, time.time(), path, out, err,
                                            kind, f"[{mix}] {what}"))
                nxt += 1
            time.sleep(0.002)
            for r in list(running):
                rc: int | None
                if r.proc is not None:
                    status = r.proc.poll()
                    finished = status is not None
                    rc = status
                else:
                    pid, status = os.waitpid(r.pid, os.WNOHANG)
                    finished = pid != 0
                    rc = os.waitstatus_to_exitcode(status) if finished else None
                if not finished:
                    if time.time() - r.t0 < timeout:
                        continue
                    if r.proc is not None:
                        r.proc.kill()
                        r.proc.wait()
                    else:
                        os.kill(r.pid, 9)
                        os.waitpid(r.pid, 0)
                    rc = None
                running.remove(r)
                stderr = r.err.read_text(errors="replace") if r.err.exists() else ""
                outcome = classify(rc, stderr, r.out)
                tally.add(r.i, r.kind, r.what, outcome, stderr)
                if outcome in BAD and keep is not None:
                    keep.mkdir(parents=True, exist_ok=True)
                    (keep / f"case{r.i}.gguf").write_bytes(r.path.read_bytes())
                for f in (r.path, r.out, r.err):
                    f.unlink(missing_ok=True)
                done += 1
                if done % 500 == 0:
                    log(f"{done}/{n_cases} cases, {time.time() - t_start:.0f} s: {dict(tally.counts)}")
    return tally


def report(t: Tally, n: int, seed: int, seconds: float) -> str:
    lines = [f"{n} cases (seed {seed}) in {seconds:.0f} s", "outcome       cases"]
    for o in GOOD + BAD:
        lines.append(f"  {o:12s} {t.counts[o]:6d}")
    lines.append("by mutation   " + " ".join(f"{o:>10s}" for o in GOOD + BAD))
    for kind in sorted(t.by_kind):
        lines.append(f"  {kind:12s}" + " ".join(f"{t.by_kind[kind][o]:10d}" for o in GOOD + BAD))
    for i, kind, what, outcome, tail in t.broken[:30]:
        lines.append(f"BROKEN case {i} ({kind}: {what}): {outcome}: {' | '.join(tail)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a case may run before it is a hang")
    p.add_argument("--exec", dest="fresh", action="store_true", help="a fresh `python cli.py` per case")
    p.add_argument("--keep", type=Path, help="save the files of broken-promise cases here")
    p.add_argument("--case", type=int, help="run only this case, in this process, and print everything")
    a = p.parse_args(argv)
    if a.case is not None:
        with tempfile.TemporaryDirectory() as tmp:
            mix, kind, what, blob = case(bases(_cache()), a.seed, a.case)
            path = Path(tmp) / "case.gguf"
            path.write_bytes(blob)
            outcome, stderr = run_inprocess(path, Path(tmp) / "case.npy")
            print(f"case {a.case} [{mix}] {kind}: {what}\n{stderr}-> {outcome}")
            return 0 if outcome in GOOD else 1
    t0 = time.time()
    tally = run(a.cases, a.seed, a.jobs, a.timeout, a.fresh, a.keep)
    print(report(tally, a.cases, a.seed, time.time() - t0))
    return 1 if any(tally.counts[o] for o in BAD) else 0


if __name__ == "__main__":
    sys.exit(main())
