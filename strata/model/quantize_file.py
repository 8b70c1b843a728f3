"""`cli.py quantize IN.gguf OUT.gguf --mix MIX`: an existing qwen4exp GGUF rewritten in a mix's types.

Each tensor gets the type make-model's mix gives it (strata.model.synth.pick_type; vectors stay F32), so a file
quantized to a mix holds exactly the types `make-model --mix` writes. Metadata is copied unchanged, the chat
template included. Streaming as convert streams: a tensor whose type stays is copied byte for byte, the others
are dequantized CHUNK_ELEMENTS values at a time, requantized, written and dropped, and the source pages are
given back after each chunk, so memory is a fixed overhead plus a few chunks per thread, whatever the file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from strata.model.convert import pipelined, row_chunks
from strata.model.gguf_file import TensorInfo
from strata.model.gguf_writer import GGUFStreamWriter
from strata.model.loader import load_model
from strata.model.safetensors_file import MappedFile
from strata.model.schema import all_specs
from strata.quant import QUANTIZABLE, QType, dequantize, quantize


def _check_out(src: Path, dst: Path) -> None:
    if not dst.parent.is_dir():
        raise ValueError(f"{dst}: the folder {dst.parent} does not exist")
    if dst.exists() and src.exists() and os.path.samefile(src, dst):
        raise ValueError(f"{dst}: is the input file; write the quantized model to another path")


def quantize_gguf(src: str | os.PathLike, dst: str | os.PathLike, mix: str, *, threads: int | None = None,
                  log: Callable[[str], None] = print,
                  progress: Callable[[str, int, int], None] | None = None) -> dict[str, QType]:
    """Write `dst`: `src` with every tensor in `mix`'s type. Returns each tensor's new type.
    `progress(tensor, bytes done, bytes total)` per chunk written."""
    from strata.model.synth import MIXES, pick_type
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}: choose one of {', '.join(MIXES)}")
    src, dst = Path(src), Path(dst)
    _check_out(src, dst)
    m = load_model(src)                      # the schema and every tensor checked before anything is written
    gf, vectors = m.file, {s.name for s in all_specs(m.cfg) if s.vector}
    types = {name: QType.F32 if name in vectors else pick_type(name, t.shape[0], mix)
             for name, t in gf.tensors.items()}
    for name, t in gf.tensors.items():            # every type dequantizes; not every type has a quantizer
        if types[name] != t.qtype and types[name] not in QUANTIZABLE:
            raise ValueError(f"mix {mix!r} gives '{name}' {types[name].name}, which strata cannot quantize to")

    mapped = MappedFile(src)

    def source(t: TensorInfo, qt: QType, pool, ahead: int):
        n_rows = t.n_elements // t.shape[0]
        chunks = row_chunks(n_rows, t.shape[0])

        def make(i: int) -> np.ndarray:
            lo, hi = chunks[i]
            a, b = t.offset + lo * t.row_bytes, t.offset + hi * t.row_bytes
            gf.check_unchanged()                 # a page past a truncated end is SIGBUS, not an error
            raw = mapped.view(a, b).reshape(hi - lo, t.row_bytes).copy()
            mapped.release(a, b)
            return raw if qt == t.qtype else quantize(dequantize(raw, t.qtype), qt)

        return lambda: pipelined(make, len(chunks), pool, ahead)

    w = GGUFStreamWriter(dst, alignment=gf.alignment)
    for key, value in gf.metadata.items():
        if key not in w:                        # the writer has put general.alignment first when it is not 32
            vt, sub = gf.value_types[key]
            w.add(key, vt, value, sub)
    workers = threads or os.cpu_count() or 1
    with ThreadPoolExecutor(workers) if workers > 1 else nullcontext() as pool:
        for name, t in gf.tensors.items():
            w.add_tensor(name, t.shape, types[name], source(t, types[name], pool, workers + 1))
        size = w.write(progress)
    changed = sum(types[n] != t.qtype for n, t in gf.tensors.items())
    log(f"wrote {dst}: {len(types)} tensors ({changed} retyped, {len(types) - changed} copied), "
        f"{size / 2**20:.1f} MiB, mix {mix}")
    return types
