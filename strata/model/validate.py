"""Checks of a GGUF beyond its layout and the architecture's keys: the kinds of the other keys strata reads, and
the values of the weights (NaN or inf), which only a scan of every byte can tell.

The architecture's keys are ModelConfig.from_metadata's (it checks each as it reads it); the tokenizer's are
here, because a tokenizer built from an array where a scalar belongs (or the reverse) fails inside its own code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import Keys

from strata.model.gguf_file import GGUFError, GGUFFile, TensorInfo
from strata.quant import QType, block_size, dequantize, type_size

_K = Keys.Tokenizer
# key -> what its value must be: "int", "bool", "str", or a list of one of them (an array of that)
KEY_KINDS: dict[str, Any] = {
    "general.architecture": "str",
    _K.MODEL: "str", _K.PRE: "str", _K.LIST: ["str"], _K.MERGES: ["str"], _K.TOKEN_TYPE: ["int"],
    _K.EOS_ID: "int", _K.BOS_ID: "int", _K.PAD_ID: "int", _K.UNK_ID: "int", _K.SEP_ID: "int",
    _K.MASK_ID: "int", _K.ADD_BOS: "bool", _K.ADD_EOS: "bool", _K.CHAT_TEMPLATE: "str",
    # make-model's records (strata.model.synth): read by inspect and bench/calibrate_routing.py, never by the forward
    "strata.synthetic": "str", "strata.routing": "str", "strata.routing.skew": "float",
    "strata.routing.lru_capacity": "float", "strata.routing.lru_hit_rate": "float",
    "strata.routing.calibration": "str",
}
_IS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "float": lambda v: isinstance(v, float),
}
_NAME = {"int": "an integer", "bool": "a boolean", "str": "a string", "float": "a float"}

SCAN_ELEMENTS = 1 << 22        # values dequantized at a time by scan_finite: 16 MB of float32


def check_metadata(gf: GGUFFile) -> None:
    """Each key of KEY_KINDS that the file has holds a value of its kind; GGUFError naming the key otherwise."""
    for key, kind in KEY_KINDS.items():
        if key not in gf.metadata:
            continue
        v = gf.metadata[key]
        if isinstance(kind, list):
            ok = isinstance(v, list) and all(map(_IS[kind[0]], v))
            want = f"an array of {_NAME[kind[0]].split(' ', 1)[1]}s"
        else:
            ok, want = _IS[kind](v), _NAME[kind]
        if not ok:
            vt, sub = gf.value_types[key]
            stored = f"an array of {sub.name}" if sub is not None else vt.name
            raise GGUFError(f"{gf.path}: key '{key}' is stored as {stored}, expected {want}")


def nonfinite_at(t: TensorInfo) -> int | None:
    """The index (ggml order, flat) of the first NaN or inf value of tensor t, or None; reads it in chunks of
    SCAN_ELEMENTS values, so memory stays bounded for any tensor."""
    bs, ts = block_size(t.qtype), type_size(t.qtype)
    blocks = t.data.reshape(-1, ts)
    per = max(1, SCAN_ELEMENTS // bs)
    for a in range(0, blocks.shape[0], per):
        if t.guard is not None:
            t.guard.check()                  # a page past a truncated end would be SIGBUS, not an error
        chunk = blocks[a:a + per]
        if t.qtype == QType.F32:
            values = chunk.reshape(-1).view(np.float32)
        elif t.qtype == QType.F16:
            values = chunk.reshape(-1).view(np.float16)
        else:
            values = dequantize(chunk.reshape(-1), t.qtype)
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            return a * bs + int(bad[0])
    return None


def scan_finite(gf: GGUFFile, progress: Callable[[str, int, int], None] | None = None) -> None:
    """GGUFError naming the first tensor (in file order) holding NaN or inf, and where; `progress(name, done,
    total)` after each tensor, in bytes."""
    total, done = sum(t.nbytes for t in gf.tensors.values()), 0
    for t in gf.tensors.values():
        at = nonfinite_at(t)
        if at is not None:
            idx = list(np.unravel_index(at, t.np_shape)) if t.n_elements else []
            raise GGUFError(f"{gf.path}: tensor '{t.name}' ({t.qtype.name}) holds a non-finite value (NaN or inf) "
                            f"at element {at} (numpy index {[int(i) for i in idx]})")
        done += t.nbytes
        if progress:
            progress(t.name, done, total)
