"""The routed experts on the host: where each lives in the GGUF, host memory for their blobs, the CPU pool that
computes misses, and the VRAM cache policy (which expert sits in which backend slot, and CPU-or-upload per miss).

k = activated experts per token, E = hidden size, F = expert width, T = rows in a step, P = (row, expert) pairs.
One expert is three contiguous slices of the stacked tensors: gate (F, row_bytes), up (F, row_bytes),
down (E, row_bytes), in the file's block format. A step's experts are grouped: each distinct expert is read,
uploaded or computed once for all the rows that routed to it.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from strata.host.direct_io import aligned_empty, open_file, pread_into, ram_bytes, spans
from strata.host.trace import clock
from strata.model.gguf_file import FileGuard
from strata.model.loader import Model
from strata.quant import QType
from strata.model.weights import Mat
from strata.quant.experts import batched, expert_batch_rows, max_threads
from strata.reference.common import F32
from strata.reference.moe import expert_ffn


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
    """Expert `expert` of layer `layer` in host memory: one buffer, three uint8 (rows, row_bytes) views, and their
    addresses for the compiled expert batch (taken once here, on the I/O thread). `alloc(nbytes)` gives the buffer
    (the CUDA backend's pinned cells, so uploads DMA straight from it); numpy memory by default. `buf`, `at`: an
    O_DIRECT read's aligned buffer, the views at buffer offsets `at` inside it."""

    def __init__(self, layer: int, expert: int, slices: tuple[ExpertSlice, ...],
                 alloc: Callable[[int], np.ndarray] | None = None, *, buf: np.ndarray | None = None,
                 at: list[int] | None = None):
        self.layer, self.expert = layer, expert
        self.nbytes = sum(s.nbytes for s in slices)        # the weights' bytes (what a CPU batch or upload moves)
        if buf is None:
            buf = alloc(self.nbytes) if alloc is not None else np.empty(self.nbytes, np.uint8)
            at = np.cumsum([0] + [s.nbytes for s in slices[:-1]]).tolist()
        self.buf = buf
        self.gate, self.up, self.down = (buf[a:a + s.nbytes].reshape(s.rows, s.row_bytes) for s, a in zip(slices, at))
        self.addr = tuple(v.__array_interface__["data"][0] for v in (self.gate, self.up, self.down))
        self.read: tuple[float, float, int] | None = None   # (t0, t1, bytes from the file) until the trace takes it

    @property
    def mem_bytes(self) -> int:
        """Host memory the blob holds (an O_DIRECT buffer's aligned spans included)."""
        return self.buf.nbytes

    def take_read(self) -> tuple[float, float, int] | None:
        r, self.read = self.read, None
        return r


def _owner(a: np.ndarray) -> object:
    """The object whose life is a's memory's: every view of a keeps it alive."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


class ExpertStore:
    """The RAM tier: expert blobs in host memory, an LRU bounded in bytes (`budget_bytes`), whose misses are read
    from the GGUF (the SSD tier) on the I/O pool, O_DIRECT unless `direct` is False or the filesystem refuses it.

    `fetch` starts the read at once (or finds the blob, or the read already in flight); blobs are whole experts
    so a CPU task or an upload never waits on part of one. Every blob read enters the LRU as most recently used
    (the policy promotes what comes in); a RAM hit moves it to the end. A VRAM hit does not touch this LRU, so the
    RAM tier holds the experts that recently missed VRAM rather than a second copy of the hottest ones.

    Reads: O_DIRECT covers each slice's aligned span (strata.host.direct_io.spans: gate and up merge where they
    touch); with numpy memory the blob's views lie inside that aligned buffer (no copy); with `alloc` (the CUDA
    backend's pinned cells, sized to the blob) the spans land in the reading thread's aligned bounce buffer and
    are copied into the cell, so an upload stays one DMA from pinned memory. Buffered: pread of the exact bytes.

    An evicted blob is only dropped from the LRU: a CPU batch or an upload that still reads it holds a reference,
    so its memory (a pinned cell included: strata.host.cells) is freed once the last reader is done. `bytes` counts
    the LRU (never above the budget); `live_bytes` every blob buffer alive (the LRU plus blobs in use or in flight).
    Thread-safe: reads finish on I/O threads.
    """

    def __init__(self, path: str, layout: ExpertLayout, budget_bytes: int | None, pool: ThreadPoolExecutor,
                 alloc: Callable[[int], np.ndarray] | None = None, *, direct: bool = True, n_expert: int = 0):
        """budget_bytes None: room for all `n_expert` experts of every layer as this store holds them (aligned spans
        with O_DIRECT), at most half the RAM."""
        self.path, self.layout, self.pool, self.alloc = path, layout, pool, alloc
        self.file = open_file(path, direct)
        self.fd = self.file.fd
        if budget_bytes is None:
            everything = sum(self.mem_bytes(il, e) for il in range(len(layout.layers)) for e in range(n_expert))
            budget_bytes = min(everything, ram_bytes() // 2)
        self.budget = budget_bytes
        self.guard = FileGuard(self.fd, path)       # a changed file fails the read, not the process
        self.bytes = self.peak_bytes = 0            # the LRU's memory, and its high-water mark
        self.live_bytes = self.peak_live_bytes = 0  # every blob buffer alive
        self.reads = 0                              # blobs read from the file
        self.ram_hits = 0                           # fetches the LRU answered
        self.ssd_bytes = 0                          # bytes read from the file (aligned spans with O_DIRECT)
        self._lru: OrderedDict[tuple[int, int], ExpertBlob] = OrderedDict()
        self._pending: dict[tuple[int, int], Future] = {}
        self._predicted: dict[int, set[int]] = {}  # layer -> experts a prefetch started reading for its next use
        # reentrant: dropping the last reference to a blob (an eviction, under the lock) runs _freed right there
        self._lock = threading.RLock()
        self._local = threading.local()             # each I/O thread's bounce buffer (alloc with O_DIRECT)

    def __len__(self) -> int:
        return len(self._lru)

    def complete(self, n_expert: int) -> list[list[ExpertBlob]] | None:
        """The blobs by layer when the tier holds every expert of every layer (nothing is left to read, so nothing
        is evicted from then on), else None."""
        n_layer = len(self.layout.layers)
        with self._lock:
            if len(self._lru) != n_layer * n_expert:
                return None
            return [[self._lru[(il, e)] for e in range(n_expert)] for il in range(n_layer)]

    def mem_bytes(self, layer: int, expert: int) -> int:
        """Host memory a blob of this expert takes here: its aligned spans where O_DIRECT reads into place."""
        parts = [(s.offset(expert), s.nbytes) for s in self.layout.layers[layer]]
        if self.file.direct and self.alloc is None:
            return sum(n for _, n, _ in spans(parts)[0])
        return sum(n for _, n in parts)

    def fetch(self, layer: int, expert: int) -> Future:
        """A future of the ExpertBlob; the read (if one is needed) is already running when this returns."""
        return self.fetch_many(layer, [expert])[0][0]

    def fetch_many(self, layer: int, experts: list[int]) -> tuple[list[Future], np.ndarray, np.ndarray]:
        """fetch for each of `experts`; which the RAM tier held (bool (n,)); which a prefetch of this layer had
        started reading (bool (n,): read from the file for this use, early, so not RAM hits)."""
        futs, in_ram, predicted = [], np.zeros(len(experts), bool), np.zeros(len(experts), bool)
        with self._lock:
            guessed = self._predicted.pop(layer, set())
            for i, expert in enumerate(experts):
                key = (layer, expert)
                if expert in guessed:
                    predicted[i] = True
                blob = self._lru.get(key)
                if blob is not None and predicted[i]:          # the prefetch's read came in already
                    self._lru.move_to_end(key)
                    done: Future = Future()
                    done.set_result(blob)
                    futs.append(done)
                    continue
                if blob is not None:
                    self._lru.move_to_end(key)
                    self.ram_hits += 1
                    in_ram[i] = True
                    done: Future = Future()
                    done.set_result(blob)
                    futs.append(done)
                    continue
                fut = self._pending.get(key)
                if fut is None:
                    fut = self._pending[key] = self.pool.submit(self._read, layer, expert)
                futs.append(fut)
        return futs, in_ram, predicted

    def prefetch(self, layer: int, experts: list[int]) -> int:
        """Start reading those of `experts` that are neither in the RAM tier nor being read: a prediction of the
        layer's next misses (it moves nothing in the LRU and counts no hit). It replaces the layer's previous
        prediction; the next fetch_many of the layer consumes it. Returns how many reads it started."""
        started = set()
        with self._lock:
            for expert in experts:
                key = (layer, expert)
                if key in self._lru or key in self._pending:
                    continue
                self._pending[key] = self.pool.submit(self._read, layer, expert)
                started.add(expert)
            self._predicted[layer] = started
        return len(started)

    def _bounce(self, nbytes: int) -> np.ndarray:
        b = getattr(self._local, "buf", None)
        if b is None or b.nbytes < nbytes:
            b = self._local.buf = aligned_empty(nbytes)
        return b[:nbytes]

    def _read(self, layer: int, expert: int) -> ExpertBlob:
        try:
            t0 = clock()
            slices = self.layout.layers[layer]
            self.guard.check()
            what = f"reading expert {expert} of layer {layer}"
            if self.file.direct:
                reads, at = spans([(s.offset(expert), s.nbytes) for s in slices])
                total = sum(n for _, n, _ in reads)
                into = aligned_empty(total) if self.alloc is None else self._bounce(total)
                for off, n, b in reads:
                    pread_into(self.fd, into[b:b + n], off, self.path, what, min(n, self.guard.size - off))
                if self.alloc is None:
                    blob = ExpertBlob(layer, expert, slices, buf=into, at=at)
                else:
                    blob = ExpertBlob(layer, expert, slices, self.alloc)
                    for v, a in zip((blob.gate, blob.up, blob.down), at):
                        v.reshape(-1)[:] = into[a:a + v.nbytes]
            else:
                blob = ExpertBlob(layer, expert, slices, self.alloc)
                total = blob.nbytes
                for s in slices:
                    os.posix_fadvise(self.fd, s.offset(expert), s.nbytes, os.POSIX_FADV_WILLNEED)
                for s, view in zip(slices, (blob.gate, blob.up, blob.down)):
                    pread_into(self.fd, view, s.offset(expert), self.path, what)
            blob.read = (t0, clock(), total)
            mem = blob.mem_bytes
            with self._lock:
                self.reads += 1
                self.ssd_bytes += total
                self.live_bytes += mem
                self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
                if mem <= self.budget:
                    self._lru[(layer, expert)] = blob
                    self.bytes += mem
                    while self.bytes > self.budget:
                        _, old = self._lru.popitem(last=False)
                        self.bytes -= old.mem_bytes
                    self.peak_bytes = max(self.peak_bytes, self.bytes)
            weakref.finalize(_owner(blob.buf), self._freed, mem).atexit = False
            return blob
        finally:
            with self._lock:
                self._pending.pop((layer, expert), None)

    def _freed(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes -= nbytes

    def close(self) -> None:
        if self.fd >= 0:
            self.file.close()
            self.fd = -1


@dataclass(frozen=True)
class CpuResult:
    parts: np.ndarray              # (P, E) float32: expert j's rows at offsets[j]:offsets[j+1], in the given order
    offsets: np.ndarray            # (m+1,) int64
    blobs: list[ExpertBlob]
    t0: float                      # first batch started (trace clock)
    t1: float                      # last batch ended


class _Batch:
    """One layer's CPU experts in flight, each over its rows of X. Experts whose blobs are in host memory wait in
    `ready`; each wave on the pool's thread computes all of them in one compiled call, until all m are done."""

    def __init__(self, pool: "CpuExpertPool", slices, X: np.ndarray, blob_futs: list[Future], offsets: np.ndarray,
                 rows: np.ndarray):
        self.pool, self.slices, self.X = pool, slices, X
        gate, up, down = slices
        m = len(blob_futs)
        self.offsets, self.rows = offsets, rows                                # (m+1,), (P,)
        self.out = np.empty((len(rows), down.rows), F32)                       # (P, E)
        self.blobs: list[ExpertBlob | None] = [None] * m
        self.ready: list[int] = []
        self.left = m
        self.lock = threading.Lock()
        self.t0: float | None = None
        self.result: Future = Future()
        self.queued = True                 # no wave before every callback is attached: blobs already here go in one
        if m == 0:
            self.result.set_result(CpuResult(self.out, self.offsets, [], clock(), clock()))
        for j, f in enumerate(blob_futs):
            f.add_done_callback(lambda f, j=j: self._blob_ready(j, f))
        with self.lock:
            self.queued = bool(self.ready)
        if self.queued:
            self._submit()

    def _fail(self, e: BaseException) -> None:
        with self.lock:
            if not self.result.done():
                self.result.set_exception(e)

    def _submit(self) -> None:
        try:
            self.pool.threads.submit(self._wave)
        except RuntimeError as e:          # the pool was shut down (engine closing)
            self._fail(e)

    def _blob_ready(self, j: int, f: Future) -> None:
        if f.exception() is not None:
            self._fail(f.exception())
            return
        with self.lock:
            self.blobs[j] = f.result()
            self.ready.append(j)
            go = not self.queued
            self.queued = True
        if go:
            self._submit()

    def _wave(self) -> None:
        with self.lock:
            js, self.ready, self.queued = sorted(self.ready), [], False
            if self.t0 is None:
                self.t0 = clock()
        if not js or self.result.done():  # nothing new, or failed already
            return
        try:
            self._compute(js)
        except BaseException as e:          # any failure ends the batch with it
            self._fail(e)
            return
        with self.lock:
            self.left -= len(js)
            if self.left == 0 and not self.result.done():
                self.result.set_result(CpuResult(self.out, self.offsets, list(self.blobs), self.t0, clock()))

    def _compute(self, js: list[int]) -> None:
        compute_experts(self.slices, self.X, self.blobs, self.offsets, self.rows, self.out, js, self.pool.exact,
                        self.pool.n_threads)


def compute_experts(slices, X: np.ndarray, blobs, offsets: np.ndarray, rows: np.ndarray, out: np.ndarray,
                    js: list[int], exact: bool, n_threads: int) -> None:
    """out[offsets[j]:offsets[j+1]] = expert blobs[j] (gate, up, down views and their addr) over X[rows[...]] for
    the sorted js: the compiled batch where the types allow it, Mat by Mat (as the reference) otherwise."""
    gate, up, down = slices
    o = offsets
    if not (batched(gate.qtype, down.qtype) and gate.qtype == up.qtype):
        for j in js:
            b = blobs[j]
            mats = [Mat("expert", s.qtype, v.view(F32) if s.qtype == QType.F32 else v, s.rows, s.n_in,
                        exact=exact) for s, v in zip(slices, (b.gate, b.up, b.down))]
            out[o[j]:o[j + 1]] = expert_ffn(*mats, X[rows[o[j]:o[j + 1]]])
        return
    addr = np.array([blobs[j].addr for j in js], np.uint64)                     # (len(js), 3)
    if len(js) == len(blobs):                         # js is sorted: all of them, in order
        expert_batch_rows(addr, X, o, rows, out, gate.rows, wt_gu=gate.qtype, wt_d=down.qtype, exact=exact,
                          n_threads=n_threads)
        return
    idx = np.concatenate([np.arange(o[j], o[j + 1]) for j in js])              # their pairs, in order
    sub = np.concatenate([[0], np.cumsum(o[np.array(js) + 1] - o[js])]).astype(np.int64)
    got = np.empty((len(idx), down.rows), F32)
    expert_batch_rows(addr, X, sub, rows[idx], got, gate.rows, wt_gu=gate.qtype, wt_d=down.qtype, exact=exact,
                      n_threads=n_threads)
    out[idx] = got


class CpuExpertPool:
    """Routed experts on the CPU: strata.quant.experts' compiled batch (numba threads over every expert's rows,
    the GIL released), launched from one pool thread. A layer's experts whose blobs are in host memory go in one
    batch; blobs that arrive while it runs go in the next, so reads and compute overlap."""

    def __init__(self, n_threads: int, exact: bool):
        self.n_threads, self.exact = max(1, min(n_threads, max_threads())), exact
        self.threads = ThreadPoolExecutor(1, thread_name_prefix="strata-experts")

    def run(self, slices: tuple[ExpertSlice, ...], X: np.ndarray, blob_futs: list[Future], offsets: np.ndarray,
            rows: np.ndarray) -> Future:
        """Outputs of the experts whose blobs `blob_futs` will give, expert j on the rows rows[offsets[j]:
        offsets[j+1]] of X (T, E) (offsets int64 (m+1,), rows int64 (P,)): a future of CpuResult."""
        return _Batch(self, slices, np.array(X, F32, copy=True), blob_futs, np.asarray(offsets, np.int64),
                      np.asarray(rows, np.int64)).result

    def close(self, wait: bool = False) -> None:
        self.threads.shutdown(wait=wait, cancel_futures=True)


class VramCache:
    """Which experts the backend holds, slot by slot: LRU within `slots` and a byte budget, hit counts per layer,
    and each expert's popularity: its routes counted with a half-life of `half_life` tokens (a route `half_life`
    tokens ago counts half as much as one now).

    The host picks the slot an upload goes to; the experts of the layer being computed are never evicted. A copy
    the host may skip (a mapped token's promotion) is ranked: it takes the least recently used expert's slot only
    if its own routes outnumber that expert's, so one-off routes neither evict the experts most tokens use nor
    spend PCIe on copies (`bench/sim_cache.py`, bench/RESULTS.md "twelfth session": the replayed flash routing at
    36% of the experts hits 78.5% ranked with 3 copies a token, 70.6% with 70 copying at an expert's second miss).
    """

    def __init__(self, slots: int, budget_bytes: int, n_layer: int, n_expert: int, half_life: float = 512):
        if half_life <= 0:
            raise ValueError(f"VramCache: a half-life of {half_life} tokens")
        self.slots, self.budget = slots, budget_bytes
        self.bytes = 0
        self._lru: OrderedDict[tuple[int, int], tuple[int, int]] = OrderedDict()   # (layer, expert) -> (slot, bytes)
        self._free = list(range(slots - 1, -1, -1))      # popped from the end: the lowest slot first
        self._out: list[int] | None = None                # withdrawn slots, ascending
        self.lookups: dict[int, int] = defaultdict(int)
        self.hits: dict[int, int] = defaultdict(int)
        self.uploads = 0
        self.half_life = float(half_life)
        # routes, each weighted by _w at its token: _w doubles every half_life tokens, so score / _w is the decayed
        # count and comparing two scores needs no decay of the whole table
        self.score = np.zeros((n_layer, n_expert), np.float64)
        self._w = 1.0

    def __len__(self) -> int:
        return len(self._lru)

    def tick(self, tokens: int) -> None:
        """`tokens` more tokens went by: a route from now on counts 2 ** (tokens / half_life) times as much."""
        self._w *= 2.0 ** (tokens / self.half_life)
        if self._w > 1e200:                 # rescale before float64 runs out (after ~340,000 half-lives' tokens)
            self.score /= self._w
            self._w = 1.0

    def popularity(self, layer: int, expert) -> np.ndarray | float:
        """Routes of (layer, expert) counted with the half-life, as of now."""
        return self.score[layer, expert] / self._w

    def record(self, layer: int, experts: np.ndarray, resident: np.ndarray, pairs: np.ndarray) -> None:
        """Count a step's routing (distinct experts (U,), the backend's resident mask, each one's (row, expert)
        pairs): hits and lookups per pair, the experts' popularity, the hits made most recently used."""
        self.lookups[layer] += int(pairs.sum())
        self.score[layer, experts] += self._w * pairs
        if resident.any():
            self.hits[layer] += int(pairs[resident].sum())
            for e in experts[resident].tolist():
                if (layer, e) in self._lru:
                    self._lru.move_to_end((layer, e))

    def count_token(self, ids: np.ndarray, resident: np.ndarray) -> None:
        """record()'s counts for a one-row step's routes of every layer at once (ids, resident: (n_layer, k))."""
        n_layer, k = ids.shape
        for il, h in enumerate(resident.sum(axis=1).tolist()):
            self.lookups[il] += k
            self.hits[il] += h
        self.score[np.repeat(np.arange(n_layer), k), ids.reshape(-1)] += self._w    # a layer's ids are distinct

    def touch_token(self, ids: np.ndarray, resident: np.ndarray) -> None:
        """record()'s recency for those routes: every hit made most recently used."""
        lru = self._lru
        for key in zip(np.nonzero(resident)[0].tolist(), ids[resident].tolist()):
            if key in lru:
                lru.move_to_end(key)

    def place(self, layer: int, expert: int, nbytes: int, keep: set[int], evict: bool = True,
              ranked: bool = False) -> int | None:
        """A slot for expert (layer, expert), evicting least recently used ones; None when nothing may go
        (every candidate is one of this layer's routed experts `keep`, or the expert exceeds the budget).
        evict=False: a free slot within the budget or None (a streamed prompt fills the cache, never evicts).
        ranked: evict only experts less popular than this one (None when the least recently used is not)."""
        if nbytes > self.budget or self.slots == 0:
            return None
        if not evict and (not self._free or self.bytes + nbytes > self.budget):
            return None
        while not self._free or self.bytes + nbytes > self.budget:
            victim = next(((k, v) for k, v in self._lru.items() if not (k[0] == layer and k[1] in keep)), None)
            if victim is None or (ranked and self.score[victim[0]] >= self.score[layer, expert]):
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

    def promotions(self, ids: np.ndarray, resident: np.ndarray, nbytes, lacks=None, cap: int | None = None):
        """A mapped token's misses placed into the cache, yielded as (layer, expert, slot) for the caller to copy:
        the token's hits made most recently used first, then per layer its misses most popular first, each over a
        less popular victim only (place ranked), the layer's routed experts kept, at most `cap` a layer. ids,
        resident (n_layer, k): the token's routes and which were resident; nbytes[layer]: a blob's bytes;
        lacks(layer, experts): which of a layer's misses are still not in VRAM (a later step may have loaded
        some), all of them when None."""
        self.touch_token(ids, resident)
        for il in range(ids.shape[0]):
            lack = ids[il][~resident[il]]
            if not lack.size:
                continue
            if lacks is not None:
                lack = lack[np.asarray(lacks(il, lack), bool)]
            lack = lack[np.argsort(-self.popularity(il, lack), kind="stable")]
            if cap is not None:
                lack = lack[:cap]
            keep = set(ids[il].tolist())
            for e in lack.tolist():
                slot = self.place(il, e, nbytes[il], keep, ranked=True)
                if slot is None:          # the next is no more popular and would face the same victim
                    break
                yield il, e, slot

    def withdraw(self, slots) -> list[tuple[int, int]]:
        """These slots leave the cache until restore() (a step of several rows writes them: the backend's stream
        buffers and batched activations, which the cache holds between such steps): their experts are dropped,
        returned as (layer, expert), and place() never picks those slots meanwhile."""
        out = {int(s) for s in slots}
        gone = [k for k, (slot, _) in self._lru.items() if slot in out]
        for k in gone:
            self.bytes -= self._lru.pop(k)[1]
        self._free = [slot for slot in self._free if slot not in out]
        self._out = sorted(out)
        return gone

    def restore(self) -> None:
        """The withdrawn slots are free again, taken after every other free slot (the next step of several rows
        takes them back, so the cache fills them last)."""
        if self._out is not None:
            self._free[:0] = self._out[::-1]
            self._out = None

    def hit_rate(self) -> float:
        n = sum(self.lookups.values())
        return sum(self.hits.values()) / n if n else 0.0


class MissCosts:
    """Running per-layer estimates of what a miss costs on each path, as the scheduler measures them: the CPU
    pool's wall time per (row, expert) pair (its work grows with the rows an expert serves), and the upload's
    (load_expert) time per expert (the same for any number of rows). They split a layer's misses."""

    ALPHA = 0.25           # EWMA weight of the newest measurement: follows drift within a few steps

    def __init__(self, n_layer: int):
        self.cpu_ms: list[float | None] = [None] * n_layer
        self.upload_ms: list[float | None] = [None] * n_layer

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.ALPHA * (new - old)

    def observe_cpu(self, layer: int, n_pairs: int, seconds: float) -> None:
        self.cpu_ms[layer] = self._ewma(self.cpu_ms[layer], seconds * 1e3 / n_pairs)

    def observe_upload(self, layer: int, n: int, seconds: float) -> None:
        self.upload_ms[layer] = self._ewma(self.upload_ms[layer], seconds * 1e3 / n)

    def n_upload(self, layer: int, pairs: np.ndarray, can_upload: bool) -> int:
        """How many of the misses to upload, the misses given by their pair counts in descending order (those
        first go up; the rest to the CPU pool). Both paths run at once, so the split minimizes the later finish.
        An unmeasured path gets one miss, to measure it."""
        n_miss = len(pairs)
        if n_miss == 0 or not can_upload:
            return 0
        c, u = self.cpu_ms[layer], self.upload_ms[layer]
        if u is None:
            return 1
        if c is None:
            return n_miss - 1 if n_miss > 1 else 0
        left = np.concatenate([np.cumsum(pairs[::-1])[::-1], [0]])          # pairs left to the CPU after k uploads
        cost = np.maximum(left * c, np.arange(n_miss + 1) * u)
        return int(np.argmin(cost))
