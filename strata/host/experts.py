"""The routed experts on the host: where each lives in the GGUF, host memory for their blobs, the CPU pool that
computes misses, and the VRAM cache policy (which expert sits in which backend slot, and CPU-or-upload per miss).

A = activated experts per token (k), E = hidden size, F = expert width. One expert is three contiguous slices of
the stacked tensors: gate (F, row_bytes), up (F, row_bytes), down (E, row_bytes), in the file's block format.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from strata.host.ple_io import pread_into
from strata.host.trace import clock
from strata.model.loader import Model
from strata.quant import QType, matvec_prepared, prepare_activation
from strata.reference.common import F32, silu

# a CPU task smaller than this costs more to dispatch from Python (~10 us) than the rows it splits off
MIN_TASK_BYTES = 128 << 10


@dataclass(frozen=True)
class ExpertSlice:
    """One of an expert's three matrices: where expert 0's rows start in the file and how far apart experts are."""
    qtype: QType
    rows: int              # n_out of one expert
    n_in: int
    row_bytes: int
    base: int              # absolute file offset of expert 0's first row
    stride: int            # bytes from one expert's rows to the next's

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def offset(self, expert: int) -> int:
        return self.base + expert * self.stride


@dataclass(frozen=True)
class ExpertLayout:
    """(gate, up, down) slices per layer, from the GGUF tensor table; a fused gate|up tensor splits in halves."""
    layers: tuple[tuple[ExpertSlice, ExpertSlice, ExpertSlice], ...]

    @classmethod
    def from_model(cls, model: Model) -> "ExpertLayout":
        gf, out = model.file, []
        for il in range(model.cfg.n_layer):
            b = f"blk.{il}."
            down = cls._slice(gf.tensor(b + "ffn_down_exps.weight"))
            if b + "ffn_gate_up_exps.weight" in gf:
                gu = cls._slice(gf.tensor(b + "ffn_gate_up_exps.weight"))
                half = gu.rows // 2
                gate = ExpertSlice(gu.qtype, half, gu.n_in, gu.row_bytes, gu.base, gu.stride)
                up = ExpertSlice(gu.qtype, half, gu.n_in, gu.row_bytes, gu.base + half * gu.row_bytes, gu.stride)
            else:
                gate = cls._slice(gf.tensor(b + "ffn_gate_exps.weight"))
                up = cls._slice(gf.tensor(b + "ffn_up_exps.weight"))
            out.append((gate, up, down))
        return cls(tuple(out))

    @staticmethod
    def _slice(t) -> ExpertSlice:
        n_in, rows = t.shape[0], t.shape[1]          # ggml [n_in, n_out, n_expert]
        return ExpertSlice(t.qtype, rows, n_in, t.row_bytes, t.offset, rows * t.row_bytes)

    def blob_bytes(self, layer: int) -> int:
        return sum(s.nbytes for s in self.layers[layer])


class ExpertBlob:
    """Expert `expert` of layer `layer` in host memory: one buffer, three uint8 (rows, row_bytes) views."""

    def __init__(self, layer: int, expert: int, slices: tuple[ExpertSlice, ...]):
        self.layer, self.expert = layer, expert
        self.buf = np.empty(sum(s.nbytes for s in slices), np.uint8)
        views, at = [], 0
        for s in slices:
            views.append(self.buf[at:at + s.nbytes].reshape(s.rows, s.row_bytes))
            at += s.nbytes
        self.gate, self.up, self.down = views
        self.read: tuple[float, float] | None = None    # the read's interval until the trace takes it

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes

    def take_read(self) -> tuple[float, float] | None:
        r, self.read = self.read, None
        return r


class ExpertStore:
    """Host memory for expert blobs: an LRU bounded in bytes, filled by preads from the GGUF on the I/O pool.

    `fetch` starts the read at once (or finds the blob, or the read already in flight); blobs are whole experts
    so a CPU task or an upload never waits on part of one. Thread-safe: reads finish on I/O threads.
    """

    def __init__(self, path: str, layout: ExpertLayout, budget_bytes: int, pool: ThreadPoolExecutor):
        self.path, self.layout, self.budget, self.pool = path, layout, budget_bytes, pool
        self.fd = os.open(path, os.O_RDONLY)
        self.bytes = 0
        self.reads = 0
        self._lru: OrderedDict[tuple[int, int], ExpertBlob] = OrderedDict()
        self._pending: dict[tuple[int, int], Future] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def fetch(self, layer: int, expert: int) -> Future:
        """A future of the ExpertBlob; the read (if one is needed) is already running when this returns."""
        key = (layer, expert)
        with self._lock:
            blob = self._lru.get(key)
            if blob is not None:
                self._lru.move_to_end(key)
                done: Future = Future()
                done.set_result(blob)
                return done
            fut = self._pending.get(key)
            if fut is None:
                fut = self._pending[key] = self.pool.submit(self._read, layer, expert)
            return fut

    def _read(self, layer: int, expert: int) -> ExpertBlob:
        try:
            t0 = clock()
            slices = self.layout.layers[layer]
            blob = ExpertBlob(layer, expert, slices)
            for s in slices:
                os.posix_fadvise(self.fd, s.offset(expert), s.nbytes, os.POSIX_FADV_WILLNEED)
            for s, view in zip(slices, (blob.gate, blob.up, blob.down)):
                pread_into(self.fd, view, s.offset(expert), self.path, f"reading expert {expert} of layer {layer}")
            blob.read = (t0, clock())
            with self._lock:
                self.reads += 1
                if blob.nbytes <= self.budget:
                    self._lru[(layer, expert)] = blob
                    self.bytes += blob.nbytes
                    while self.bytes > self.budget:
                        _, old = self._lru.popitem(last=False)
                        self.bytes -= old.nbytes
            return blob
        finally:
            with self._lock:
                self._pending.pop((layer, expert), None)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(frozen=True)
class CpuResult:
    parts: np.ndarray              # (m, E) float32: the experts' outputs, in the order they were given
    blobs: list[ExpertBlob]
    t0: float                      # first task started (trace clock)
    t1: float                      # last task ended


def _mv(w: np.ndarray, s: ExpertSlice, act, x: np.ndarray, out: np.ndarray, r0: int, r1: int) -> None:
    """out[r0:r1] = W[r0:r1] @ x exactly as strata.model.weights.Mat computes it, so parts match the reference."""
    if s.qtype == QType.F32:
        out[r0:r1] = w[r0:r1].view(np.float32) @ x        # Mat multiplies F32 with BLAS, straight from the rows
    else:
        matvec_prepared(w, s.qtype, act, out, r0, r1)


def _cuts(rows: int, parts: int) -> list[tuple[int, int]]:
    edges = [rows * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


class _Batch:
    """One layer's CPU experts in flight: per expert, gate|up row chunks, then down row chunks, then done."""

    def __init__(self, pool: "CpuExpertPool", slices, x: np.ndarray, blob_futs: list[Future]):
        self.pool, self.slices = pool, slices
        gate, up, down = slices
        m = len(blob_futs)
        self.x = x
        self.act = {qt: prepare_activation(x, qt, pool.exact) for qt in {gate.qtype, up.qtype} if qt != QType.F32}
        self.g = np.empty((m, gate.rows), F32)            # (m, F)
        self.u = np.empty((m, up.rows), F32)              # (m, F)
        self.out = np.empty((m, down.rows), F32)          # (m, E)
        self.blobs: list[ExpertBlob | None] = [None] * m
        # parts per matrix: enough chunks to give every thread work, none smaller than MIN_TASK_BYTES
        per = max(1, pool.n_threads // m)
        self.gu_cuts = _cuts(gate.rows, max(1, min(per, (gate.nbytes + up.nbytes) // MIN_TASK_BYTES)))
        self.dn_cuts = _cuts(down.rows, max(1, min(per, down.nbytes // MIN_TASK_BYTES)))
        self.left_gu = [len(self.gu_cuts)] * m
        self.left_dn = [len(self.dn_cuts)] * m
        self.left = m
        self.lock = threading.Lock()
        self.t0: float | None = None
        self.result: Future = Future()
        for j, f in enumerate(blob_futs):
            f.add_done_callback(lambda f, j=j: self._blob_ready(j, f))

    def _fail(self, e: BaseException) -> None:
        with self.lock:
            if not self.result.done():
                self.result.set_exception(e)

    def _submit(self, fn, *args) -> None:
        def run():
            if self.result.done():        # failed already: drop the rest
                return
            with self.lock:
                if self.t0 is None:
                    self.t0 = clock()
            try:
                fn(*args)
            except BaseException as e:      # any failure ends the batch with it
                self._fail(e)
        try:
            self.pool.threads.submit(run)
        except RuntimeError as e:          # the pool was shut down (engine closing)
            self._fail(e)

    def _blob_ready(self, j: int, f: Future) -> None:
        if f.exception() is not None:
            self._fail(f.exception())
            return
        self.blobs[j] = f.result()
        for r0, r1 in self.gu_cuts:
            self._submit(self._gate_up, j, r0, r1)

    def _gate_up(self, j: int, r0: int, r1: int) -> None:
        gate, up, down = self.slices
        b = self.blobs[j]
        _mv(b.gate, gate, self.act.get(gate.qtype), self.x, self.g[j], r0, r1)
        _mv(b.up, up, self.act.get(up.qtype), self.x, self.u[j], r0, r1)
        with self.lock:
            self.left_gu[j] -= 1
            last = self.left_gu[j] == 0
        if last:
            h = (silu(self.g[j]) * self.u[j]).astype(F32)   # (F,) as reference.moe.expert_ffn forms it
            act = prepare_activation(h, down.qtype, self.pool.exact) if down.qtype != QType.F32 else None
            if len(self.dn_cuts) == 1:                       # one chunk: go on in this thread, no handoff
                self._down(j, h, act, *self.dn_cuts[0])
                return
            for r0d, r1d in self.dn_cuts:
                self._submit(self._down, j, h, act, r0d, r1d)

    def _down(self, j: int, h: np.ndarray, act, r0: int, r1: int) -> None:
        down = self.slices[2]
        _mv(self.blobs[j].down, down, act, h, self.out[j], r0, r1)
        with self.lock:
            self.left_dn[j] -= 1
            if self.left_dn[j] == 0:
                self.left -= 1
            finished = self.left == 0 and not self.result.done()
            if finished:
                self.result.set_result(CpuResult(self.out, list(self.blobs), self.t0, clock()))


class CpuExpertPool:
    """Routed experts on the CPU: strata.quant's kernels (they release the GIL) on a thread pool, parallel over
    experts and, when there are fewer experts than threads, over rows. Each expert starts as soon as its blob
    is in host memory, so its read and its neighbours' compute overlap."""

    def __init__(self, n_threads: int, exact: bool):
        self.n_threads, self.exact = n_threads, exact
        self.threads = ThreadPoolExecutor(n_threads, thread_name_prefix="strata-experts")

    def run(self, slices: tuple[ExpertSlice, ...], x: np.ndarray, blob_futs: list[Future]) -> Future:
        """Outputs of the experts whose blobs `blob_futs` will give, for input x (E,): a future of CpuResult."""
        return _Batch(self, slices, np.array(x, F32, copy=True), blob_futs).result

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)


class VramCache:
    """Which experts the backend holds, slot by slot: LRU within `slots` and a byte budget, hit counts per layer.

    The host picks the slot an upload goes to; the experts of the layer being computed are never evicted.
    """

    def __init__(self, slots: int, budget_bytes: int):
        self.slots, self.budget = slots, budget_bytes
        self.bytes = 0
        self._lru: OrderedDict[tuple[int, int], tuple[int, int]] = OrderedDict()   # (layer, expert) -> (slot, bytes)
        self._free = list(range(slots - 1, -1, -1))
        self.lookups: dict[int, int] = defaultdict(int)
        self.hits: dict[int, int] = defaultdict(int)
        self.uploads = 0

    def __len__(self) -> int:
        return len(self._lru)

    def record(self, layer: int, ids: list[int], resident: list[bool]) -> None:
        """Count a routing's hits (the backend's `resident` mask) and make them most recently used."""
        self.lookups[layer] += len(ids)
        n = sum(resident)
        if n:
            self.hits[layer] += n
            for e, r in zip(ids, resident):
                if r and (layer, e) in self._lru:
                    self._lru.move_to_end((layer, e))

    def place(self, layer: int, expert: int, nbytes: int, keep: set[int]) -> int | None:
        """A slot for expert (layer, expert), evicting least recently used ones; None when nothing may go
        (every candidate is one of this layer's routed experts `keep`, or the expert exceeds the budget)."""
        if nbytes > self.budget or self.slots == 0:
            return None
        while not self._free or self.bytes + nbytes > self.budget:
            victim = next(((k, v) for k, v in self._lru.items() if not (k[0] == layer and k[1] in keep)), None)
            if victim is None:
                return None
            key, (slot, size) = victim
            del self._lru[key]
            self._free.append(slot)
            self.bytes -= size
        slot = self._free.pop()
        self._lru[(layer, expert)] = (slot, nbytes)
        self.bytes += nbytes
        self.uploads += 1
        return slot

    def hit_rate(self) -> float:
        n = sum(self.lookups.values())
        return sum(self.hits.values()) / n if n else 0.0


class MissCosts:
    """Running per-layer estimates of what one miss costs on each path, as the scheduler measures them: the CPU
    pool's wall time per expert, and the upload's (load_expert) time per expert. They split a layer's misses."""

    ALPHA = 0.25           # EWMA weight of the newest measurement: follows drift within a few tokens

    def __init__(self, n_layer: int):
        self.cpu_ms: list[float | None] = [None] * n_layer
        self.upload_ms: list[float | None] = [None] * n_layer

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.ALPHA * (new - old)

    def observe_cpu(self, layer: int, n: int, seconds: float) -> None:
        self.cpu_ms[layer] = self._ewma(self.cpu_ms[layer], seconds * 1e3 / n)

    def observe_upload(self, layer: int, n: int, seconds: float) -> None:
        self.upload_ms[layer] = self._ewma(self.upload_ms[layer], seconds * 1e3 / n)

    def n_upload(self, layer: int, n_miss: int, can_upload: bool) -> int:
        """How many of n_miss misses to upload (the rest go to the CPU pool); both paths run at once, so the
        split minimizes the later finish. An unmeasured path gets one miss, to measure it."""
        if n_miss == 0 or not can_upload:
            return 0
        c, u = self.cpu_ms[layer], self.upload_ms[layer]
        if u is None:
            return 1
        if c is None:
            return n_miss - 1 if n_miss > 1 else 0
        return min(range(n_miss + 1), key=lambda k: (max((n_miss - k) * c, k * u), k))
