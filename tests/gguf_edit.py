"""Test helpers that rewrite GGUF files: edited copies for bad-file tests, dequantized F32 twins for quant tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from strata.model.gguf_file import GGUFFile
from strata.model.gguf_writer import GGUFStreamWriter
from strata.quant import QType, dequantize


def rewrite(src: Path, dst: Path, *, meta=None, drop_meta=(), drop_tensor=None, reshape=None, retype=None):
    """Copy a GGUF with edits: metadata overrides {key: (vtype, value, sub)}, a tensor dropped, reshaped or retyped."""
    gf = GGUFFile(src)
    w = GGUFStreamWriter(dst)
    for k, v in gf.metadata.items():
        if k in drop_meta:
            continue
        vt, sub = gf.value_types[k]
        if meta and k in meta:
            vt, v, sub = meta[k]
        w.add(k, vt, v, sub)
    for name, t in gf.tensors.items():
        if name == drop_tensor:
            continue
        shape, qt, data = t.shape, t.qtype, np.asarray(t.data)
        if reshape and name == reshape[0]:
            shape = reshape[1]
        if retype and name == retype[0]:
            qt = retype[1]
            data = np.zeros(t.n_elements // 32 * 34, np.uint8)
        w.add_tensor(name, shape, qt, data)
    w.write()
    return dst


def reference_dequantize(t) -> np.ndarray:
    """A tensor's float32 values by gguf's own dequantizer (Q2_0, which gguf 0.19 lacks, by strata's)."""
    import gguf
    if t.qtype == QType.Q2_0:
        return dequantize(t.data, t.qtype).reshape(-1)
    return gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType(int(t.qtype))).reshape(-1)


def dequantized_copy(src: Path, dst: Path) -> Path:
    """The same model with every tensor stored as F32, values from gguf's dequantizer."""
    gf = GGUFFile(src)
    w = GGUFStreamWriter(dst)
    for k, v in gf.metadata.items():
        vt, sub = gf.value_types[k]
        w.add(k, vt, v, sub)
    for name, t in gf.tensors.items():
        w.add_tensor(name, t.shape, QType.F32, reference_dequantize(t).astype(np.float32))
    w.write()
    return dst
