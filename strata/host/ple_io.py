"""PLE row reads: a step's rows of `per_layer_token_embd` (16 per token, deduplicated over the step), from an
optional RAM cache of hot rows or from the GGUF, then dequantized.

The table (28.8 GB at the real geometry) is read by rows at their file offsets, not through the mapping, so a
step's reads can be issued together as soon as its tokens are known (the scheduler starts a prompt's next chunk a
step early). With O_DIRECT (strata.host.direct_io) a row is the 4 KiB block holding it (two where it straddles a
block boundary): the step's blocks are deduplicated, runs of adjacent blocks merged into one read, and the reads
spread over `threads` reader threads, so up to that many are in flight at once (queue depth = threads). Buffered
(the filesystem refused O_DIRECT, or direct=False): POSIX_FADV_WILLNEED on every row first puts all of them in
flight, then one pread a row.

The hot-row cache (RowCache, `cache_bytes`; 0: none) holds raw rows: an 8-way set-associative array, LRU within a
set (a step's new rows fill a set's ways oldest first), sized to its budget exactly (tags, stamps and rows are
three numpy arrays), so a prefill chunk's thousands of lookups are a few vectorized operations and no per-entry
Python object counts against the budget unseen.

The whole table in RAM (load_table; HostConfig.ple_cache_bytes at least the table's size, or by default when it
takes at most a quarter of the RAM): a step's rows are then a gather and a dequantization on the caller's thread,
with no read and no thread handoff. On the H200 the rows of a decode token waited 1.0-1.7 ms on O_DIRECT reads and
the hot-row cache (bench/RESULTS.md), 8-15% of a token with every weight in VRAM; the table is 2.9 GB in the
benches' files and 28.8 GB in the real model's.

A read error, a short read, or a file changed since it was opened (FileGuard: size, mtime) is an OSError naming the
file, which fails the requests of the step that needed the rows.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from strata.host.direct_io import ALIGN, aligned_empty, open_file, pread_into
from strata.host.trace import clock
from strata.model.gguf_file import FileGuard, TensorInfo
from strata.quant import dequantize

__all__ = ["PleReader", "PleRows", "RowCache", "pread_into"]

MAX_RUN = 64               # adjacent blocks merged into one read at most (256 KiB): longer runs split for parallelism
LOAD_CHUNK = 64 << 20      # load_table's reads
INLINE_ROWS = 1024          # PleReader.start: in-RAM reads up to this many rows run on the caller's thread
PLE_CACHE = 64 << 20       # the hot-row cache when the whole table is not held (HostConfig.ple_cache_bytes=None)


@dataclass(frozen=True)
class PleRows:
    """Table rows read for a step, and how the read went."""
    e: np.ndarray          # (U, row) float32: the rows, dequantized, in the order asked for
    nbytes: int            # bytes read from the file (aligned blocks with O_DIRECT); 0 when the cache had them all
    t0: float              # trace clock, the I/O thread's view
    t1: float
    hits: int = 0          # rows the RAM cache gave
    reads: int = 0         # preads issued
    vec: np.ndarray | None = None   # (n, heads x row): rows gathered per token (start's `gather`), when asked


class RowCache:
    """Raw table rows in RAM, at most `budget_bytes` in all: n_sets x WAYS entries, LRU within a set.
    tags (n_sets, WAYS) int64 row index (-1: empty), stamp (n_sets, WAYS) int64 last use, data (n_sets, WAYS,
    row_bytes) uint8."""

    WAYS = 8

    def __init__(self, budget_bytes: int, row_bytes: int):
        self.n_sets = max(0, budget_bytes // ((row_bytes + 16) * self.WAYS))
        self.tags = np.full((self.n_sets, self.WAYS), -1, np.int64)
        self.stamp = np.zeros((self.n_sets, self.WAYS), np.int64)
        self.data = np.zeros((self.n_sets, self.WAYS, row_bytes), np.uint8)     # pages come in as rows do
        self.tick = 0

    @property
    def nbytes(self) -> int:
        return self.tags.nbytes + self.stamp.nbytes + self.data.nbytes

    def get(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Copy the cached ones of rows (U,) into out (U, row_bytes); their mask (U,) bool."""
        if self.n_sets == 0:
            return np.zeros(len(rows), bool)
        self.tick += 1
        s = rows % self.n_sets
        m = self.tags[s] == rows[:, None]                    # (U, WAYS)
        hit = m.any(axis=1)
        hs, hw = s[hit], m[hit].argmax(axis=1)
        out[hit] = self.data[hs, hw]
        self.stamp[hs, hw] = self.tick
        return hit

    def put(self, rows: np.ndarray, raw: np.ndarray) -> None:
        """Insert rows (distinct, not cached) with their raw bytes (U, row_bytes): the i-th of a set's new rows
        takes that set's i-th least recently used way (past WAYS new rows in one set, the rest are not kept)."""
        if self.n_sets == 0 or not len(rows):
            return
        order = np.argsort(rows % self.n_sets, kind="stable")
        s = rows[order] % self.n_sets                                # sorted by set
        rank = np.arange(len(s)) - np.searchsorted(s, s)             # i: the i-th new row of its set
        keep = rank < self.WAYS
        s, rank, order = s[keep], rank[keep], order[keep]
        w = np.argsort(self.stamp[s], axis=1, kind="stable")[np.arange(len(s)), rank]
        self.tags[s, w] = rows[order]
        self.data[s, w] = raw[order]
        self.stamp[s, w] = self.tick


class PleReader:
    """Reads PLE table rows of one GGUF file. `pool` runs each step's read (start); `threads` reader threads issue
    its O_DIRECT reads; `cache_bytes` bounds the hot-row cache. Thread-safe (pread shares no file position)."""

    def __init__(self, path: str, table: TensorInfo, pool: ThreadPoolExecutor, *, direct: bool = True,
                 cache_bytes: int = 0, threads: int = 16):
        self.path, self.pool = path, pool
        self.qtype = table.qtype
        self.base, self.row_bytes = table.offset, table.row_bytes      # absolute file offset of row 0
        self.table_bytes = table.nbytes
        self.table: np.ndarray | None = None           # (rows, row_bytes) uint8 once load_table has run
        self.file = open_file(path, direct)
        self.fd = self.file.fd
        self.guard = FileGuard(self.fd, path)
        self.cache = RowCache(cache_bytes, self.row_bytes) if cache_bytes > 0 else None
        self._lock = threading.Lock()                  # the cache: a read may run on any thread
        self._fan = ThreadPoolExecutor(threads, thread_name_prefix="strata-ple-read") if self.file.direct else None
        self.threads = threads
        self.rows_asked = self.hits = self.ssd_bytes = 0     # totals: rows asked, the cache gave, bytes read

    def start(self, rows: np.ndarray, gather: np.ndarray | None = None) -> Future:
        """Begin reading table rows `rows` (U,) (a step's, deduplicated); the future gives PleRows, with `vec` the
        rows per token when gather (n, heads) indexes rows for each token. With the table in RAM, reads of at
        most INLINE_ROWS rows (a decode token's) are gathered now, on this thread, where a thread hop would cost
        more: the future is done when it is returned; larger ones (a prompt chunk's: ~40 ms of gathering for 4096
        tokens at the flash geometry, which the PLE layer's launch would wait for) run on the pool."""
        rows = np.asarray(rows, np.int64)

        def read() -> PleRows:
            got = self.read_rows(rows)
            if gather is None:
                return got
            return replace(got, vec=np.take(got.e, gather, axis=0).reshape(len(gather), -1))

        if self.table is None or len(rows) > INLINE_ROWS:
            return self.pool.submit(read)
        f: Future = Future()
        try:
            f.set_result(read())
        except Exception as e:                   # raised where the future is awaited, like a failed read
            f.set_exception(e)
        return f

    def load_table(self, progress=None) -> int:
        """Read the whole table into RAM (sequential reads of LOAD_CHUNK bytes); progress(bytes done, bytes in
        all) after each. Later steps read no row from the file. Returns the bytes read."""
        if self.table is not None:
            return 0
        self.guard.check()
        a0 = self.base - self.base % ALIGN
        span = self.base + self.table_bytes - a0
        buf = aligned_empty(-(-span // ALIGN) * ALIGN)
        size = self.guard.size
        for at in range(0, span, LOAD_CHUNK):
            n = min(LOAD_CHUNK, len(buf) - at)
            pread_into(self.fd, buf[at:at + n], a0 + at, self.path, "reading the PLE table", min(n, size - a0 - at))
            if progress is not None:
                progress(min(at + n, span), span)
        off = self.base - a0
        self.table = buf[off:off + self.table_bytes].reshape(-1, self.row_bytes)
        self.cache = None                        # every row is in the table
        with self._lock:
            self.ssd_bytes += span
        return span

    def read_rows(self, rows: np.ndarray) -> PleRows:
        t0 = clock()
        self.guard.check()
        rows = np.asarray(rows, np.int64)
        if self.table is not None:
            with self._lock:
                self.rows_asked += len(rows)
                self.hits += len(rows)
            e = dequantize(self.table[rows], self.qtype).reshape(len(rows), -1).astype(np.float32, copy=False)
            return PleRows(e, 0, t0, clock(), len(rows), 0)
        raw = np.empty((len(rows), self.row_bytes), np.uint8)          # (U, row_bytes)
        if self.cache is not None:
            with self._lock:
                hit = self.cache.get(rows, raw)
        else:
            hit = np.zeros(len(rows), bool)
        miss = np.flatnonzero(~hit)
        nbytes = n_reads = 0
        if miss.size:
            got = raw if miss.size == len(rows) else raw[miss]
            nbytes, n_reads = (self._read_direct if self.file.direct else self._read_buffered)(rows[miss], got)
            if got is not raw:
                raw[miss] = got
            if self.cache is not None:
                with self._lock:
                    self.cache.put(rows[miss], got)
        with self._lock:
            self.rows_asked += len(rows)
            self.hits += len(rows) - miss.size
            self.ssd_bytes += nbytes
        e = dequantize(raw, self.qtype).reshape(len(rows), -1).astype(np.float32, copy=False)
        return PleRows(e, nbytes, t0, clock(), len(rows) - miss.size, n_reads)

    def _read_buffered(self, rows: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        offsets = [self.base + int(r) * self.row_bytes for r in rows]
        for off in offsets:                  # every read in flight at once: the kernel queues them all
            os.posix_fadvise(self.fd, off, self.row_bytes, os.POSIX_FADV_WILLNEED)
        for i, (r, off) in enumerate(zip(rows, offsets)):
            pread_into(self.fd, out[i], off, self.path, f"reading PLE table row {int(r)}")
        return out.nbytes, len(rows)

    def _read_direct(self, rows: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        """rows' bytes into out (U, row_bytes) through the aligned blocks that hold them. B = distinct blocks."""
        off = self.base + rows * self.row_bytes                       # (U,) file offsets
        first = off // ALIGN
        blocks = np.unique(np.concatenate([first, (off + self.row_bytes - 1) // ALIGN]))     # (B,) sorted
        buf = aligned_empty(len(blocks) * ALIGN)                      # block i of `blocks` at i * ALIGN
        cut = np.flatnonzero(np.diff(blocks) != 1) + 1                # runs of adjacent blocks
        starts = np.concatenate([[0], cut])
        ends = np.concatenate([cut, [len(blocks)]])
        runs = [(a, min(a + MAX_RUN, b)) for a0, b in zip(starts.tolist(), ends.tolist())
                for a in range(a0, b, MAX_RUN)]
        size = self.guard.size

        def read(group: list[tuple[int, int]]) -> None:
            for a, b in group:
                at = int(blocks[a]) * ALIGN
                n = (b - a) * ALIGN
                pread_into(self.fd, buf[a * ALIGN:b * ALIGN], at, self.path,
                           f"reading PLE table blocks {int(blocks[a])}..{int(blocks[b - 1])}", min(n, size - at))

        n_groups = min(self.threads, len(runs))
        groups = [runs[i::n_groups] for i in range(n_groups)]
        if n_groups <= 1:
            read(runs)
        else:                                # every group's reads in flight at once; the first error is raised
            futs = [self._fan.submit(read, g) for g in groups]
            errs = [f.exception() for f in futs]
            err = next((x for x in errs if x is not None), None)
            if err is not None:
                raise err
        pos = np.searchsorted(blocks, first) * ALIGN + off % ALIGN    # (U,) each row's first byte in buf
        out[:] = buf[pos[:, None] + np.arange(self.row_bytes)]
        return buf.nbytes, len(runs)

    def close(self) -> None:
        if self._fan is not None:
            self._fan.shutdown(wait=False, cancel_futures=True)
        if self.fd >= 0:
            self.file.close()
            self.fd = -1
