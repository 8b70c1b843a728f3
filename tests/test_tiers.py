"""The three tiers (issue 16): VRAM cache, the RAM tier of expert blobs under a byte budget, and the file read past
the page cache (O_DIRECT, or buffered where the filesystem refuses it), for experts and PLE rows. Every tier path
gives the all-in-RAM path's logits bit for bit; an I/O error on any read path ends the streams of the step that
needed it and the engine serves on; the RAM tier and the PLE cache stay within their budgets; the trace counts
where every expert came from."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import pytest

import cli
from strata.engine import Engine, EngineError, HostConfig
from strata.host import direct_io, experts as experts_mod, ple_io
from strata.host.backend import CpuBackend
from strata.host.cells import Cells, numpy_chunks
from strata.host.direct_io import ALIGN, aligned_empty, open_file, spans
from strata.host.experts import ExpertLayout, ExpertStore
from strata.host.ple_io import PleReader, RowCache
from strata.host.scheduler import Scheduler
from strata.host.trace import load, split_io, subtract, summarize
from strata.model.loader import load_model
from strata.quant import dequantize
from strata.sampling import SamplingParams

# tiny preset: vocab 512, EOS 500; the repeats give the PLE cache and the RAM tier something to hit
TOKENS = [3, 17, 500, 42, 99, 500, 500, 7, 311, 12, 3, 17, 500, 42, 260, 5, 88, 401, 23, 64, 3, 17]
GREEDY = SamplingParams(max_tokens=6, stop_at_eos=False)


@pytest.fixture(scope="module")
def realistic_tiny(tmp_path_factory):
    """The tiny geometry in the realistic type mix (Q2_0 gate/up, Q8_0 down: blobs unlike the F32 ones)."""
    from strata.model.synth import make_model
    path = tmp_path_factory.mktemp("tiers-realistic") / "tiny.gguf"
    make_model("tiny", path, seed=1, mix="realistic", log=lambda s: None)
    return path


def refuse_o_direct(monkeypatch) -> None:
    """The filesystem refuses O_DIRECT at open, as tmpfs on older kernels and many FUSE filesystems do."""
    real = os.open

    def fake(path, flags, *args, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args, **kw)
    monkeypatch.setattr(os, "open", fake)


def blob_mem(path, direct: bool = True) -> int:
    """Host memory a blob takes in numpy memory (its aligned spans with O_DIRECT), the largest of layer 0's."""
    m = load_model(path)
    store = ExpertStore(str(path), ExpertLayout.from_model(m), 0, ThreadPoolExecutor(1), direct=direct)
    try:
        return max(store.mem_bytes(0, e) for e in range(m.cfg.n_expert))
    finally:
        store.close()


class CellsCpu(CpuBackend):
    """The CPU backend handing the store pinned-like cells through host_alloc (the CUDA backend's hook): O_DIRECT
    reads go through the bounce buffer into the cell, and the CPU pool reads the cell."""

    def __init__(self, model):
        super().__init__(model)
        self.cells = None

    def host_alloc(self, nbytes):
        if self.cells is None:
            self.cells = Cells(nbytes, numpy_chunks, chunk_bytes=4 * nbytes)
        return self.cells.take(nbytes)


async def all_in_ram(path, tokens, step_tokens) -> np.ndarray:
    """The reference path of this file: every expert preloaded into an unbounded RAM tier."""
    async with Engine(load_model(path), host=HostConfig(experts="host", step_tokens=step_tokens)) as e:
        await e.preload_experts()
        reads = e.scheduler.store.reads
        out = await e.score(tokens)
        assert e.scheduler.store.reads == reads              # nothing was read again
        return out


# (label, HostConfig fields, with the budget in blobs, refuse O_DIRECT, cells backend)
CASES = [
    ("SSD every use, O_DIRECT", dict(host_budget_blobs=0, ple_cache_bytes=0), False, False),
    ("SSD every use, O_DIRECT refused", dict(host_budget_blobs=0, ple_cache_bytes=0), True, False),
    ("RAM + SSD, PLE cache, O_DIRECT", dict(host_budget_blobs=40, ple_cache_bytes=3000), False, False),
    ("RAM + SSD, PLE cache, buffered", dict(host_budget_blobs=40, ple_cache_bytes=3000, direct_io=False), False,
     False),
    ("SSD every use, cells (bounce)", dict(host_budget_blobs=0, ple_cache_bytes=0), False, True),
    ("RAM + SSD, cells (bounce)", dict(host_budget_blobs=40, ple_cache_bytes=1 << 20), False, True),
    ("RAM + SSD, the whole PLE table in RAM", dict(host_budget_blobs=40, ple_cache_bytes=1 << 40), False, False),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("mix", ["f32", "realistic"])
@pytest.mark.parametrize("label,fields,refuse,cells", CASES, ids=[c[0] for c in CASES])
async def test_tier_paths_equal_all_in_ram(label, fields, refuse, cells, mix, tiny_gguf, realistic_tiny,
                                           monkeypatch):
    path = tiny_gguf if mix == "f32" else realistic_tiny
    want = await all_in_ram(path, TOKENS, step_tokens=3)
    fields = dict(fields)
    direct = fields.get("direct_io", True) and not refuse
    budget = fields.pop("host_budget_blobs") * blob_mem(path, direct and not cells)     # cells hold blobs tight
    if refuse:
        refuse_o_direct(monkeypatch)
    model = load_model(path)
    backend = CellsCpu(model) if cells else CpuBackend(model)
    sched = Scheduler(model, backend, HostConfig(host_budget_bytes=budget, step_tokens=3, **fields))
    try:
        got = await sched.score(TOKENS)
        store, ple = sched.store, sched.ple
        assert store.file.direct == ple.file.direct == direct
        for i in range(len(TOKENS)):
            assert np.array_equal(got[i], want[i]), \
                f"{label}: position {i}: logits differ by up to {np.abs(got[i] - want[i]).max():.3g}"
        assert store.reads > 0 and store.ssd_bytes >= store.reads * sched.layout.blob_bytes(0)
        if budget == 0:
            assert len(store) == 0 and store.ram_hits == 0 and store.peak_bytes == 0
        else:                     # a layer's experts exceed the budget: hits, evictions and re-reads all happen
            assert store.ram_hits > 0 and store.reads > len(store) and store.peak_bytes <= budget
        if fields["ple_cache_bytes"] >= ple.table_bytes:     # read once, at open: every step's rows from RAM
            assert ple.table is not None and ple.cache is None
            assert ple.hits == ple.rows_asked > 0 and ple.ssd_bytes >= ple.table_bytes
        elif fields["ple_cache_bytes"]:
            assert 0 < ple.hits < ple.rows_asked and ple.cache.nbytes <= fields["ple_cache_bytes"]
        else:
            assert ple.hits == 0 and ple.ssd_bytes > 0
        if cells:                 # every blob in a cell, and cells reused once their blobs were dropped
            assert all(backend.cells.owns(b.gate) and backend.cells.owns(b.down) for b in store._lru.values())
            assert len(backend.cells._chunks) * backend.cells.per_chunk < store.reads
    finally:
        await sched.aclose()


@pytest.mark.parametrize("mode", ["direct", "direct+cells", "buffered"])
def test_every_blob_and_row_equals_the_file(mode, realistic_tiny):
    """Each expert's three views hold exactly the file's bytes at the tensor's rows, and each PLE row the table's,
    however they were read (aligned spans into place, through the bounce buffer into a cell, buffered)."""
    m = load_model(realistic_tiny)
    layout = ExpertLayout.from_model(m)
    cells = Cells(layout.blob_bytes(0), numpy_chunks) if mode == "direct+cells" else None
    pool = ThreadPoolExecutor(4)
    store = ExpertStore(str(realistic_tiny), layout, 1 << 30, pool, alloc=cells.take if cells else None,
                        direct=mode != "buffered")
    table = m.file.tensor("per_layer_token_embd.weight")
    ple = PleReader(str(realistic_tiny), table, pool, direct=mode != "buffered", cache_bytes=1 << 16, threads=4)
    file = np.memmap(realistic_tiny, np.uint8, "r")
    try:
        assert store.file.direct == (mode != "buffered")
        for il in range(m.cfg.n_layer):
            for e, fut in enumerate(store.fetch_many(il, list(range(m.cfg.n_expert)))[0]):
                blob = fut.result()
                for s, view in zip(layout.layers[il], (blob.gate, blob.up, blob.down)):
                    assert np.array_equal(view.reshape(-1), file[s.offset(e):s.offset(e) + s.nbytes]), (il, e)
                if cells is not None:
                    assert all(cells.owns(v) for v in (blob.gate, blob.up, blob.down))
        n_rows = table.shape[1]
        rng = np.random.default_rng(0)
        for rows in (np.arange(n_rows - 40, n_rows), rng.choice(n_rows, 300, replace=False), np.array([0, 1, 2])):
            for _ in range(2):                                  # the second pass: from the cache, in part
                raw = np.stack([table.data[r * table.row_bytes:(r + 1) * table.row_bytes] for r in rows])
                want = dequantize(raw, table.qtype).reshape(len(rows), -1)
                assert np.array_equal(ple.read_rows(rows).e, want)
        assert ple.hits > 0
        assert ple.load_table() >= table.nbytes and ple.table.shape == (n_rows, table.row_bytes)
        for rows in (np.arange(n_rows - 40, n_rows), rng.choice(n_rows, 300, replace=False)):
            raw = np.stack([table.data[r * table.row_bytes:(r + 1) * table.row_bytes] for r in rows])
            fut = ple.start(rows)                               # gathered on this thread: done when returned
            assert fut.done() and np.array_equal(fut.result().e, dequantize(raw, table.qtype).reshape(len(rows), -1))
            assert fut.result().nbytes == 0 and fut.result().hits == len(rows)
        # a prompt chunk's read (more than INLINE_ROWS rows) runs on the pool, gathered per token there
        rows = rng.integers(0, n_rows, ple_io.INLINE_ROWS + 1)
        gather = rng.integers(0, len(rows), (7, 3))
        raw = np.stack([table.data[r * table.row_bytes:(r + 1) * table.row_bytes] for r in rows])
        want = dequantize(raw, table.qtype).reshape(len(rows), -1)
        got = ple.start(rows, gather=gather).result(timeout=30)
        assert np.array_equal(got.e, want) and np.array_equal(got.vec, want[gather].reshape(7, -1))
        assert ple.start(rows[:3]).result().vec is None
    finally:
        store.close()
        ple.close()
        pool.shutdown()


def test_evicted_blob_lives_while_read(tiny_gguf):
    """A blob the RAM tier evicted keeps its memory (its cell is not handed out again) while a reader holds it;
    once the last reference is gone the cell is reused and live_bytes falls back to the LRU's bytes."""
    m = load_model(tiny_gguf)
    layout = ExpertLayout.from_model(m)
    n = layout.blob_bytes(0)
    cells = Cells(n, numpy_chunks, chunk_bytes=n)               # one cell per chunk: a new chunk shows in nbytes
    store = ExpertStore(str(tiny_gguf), layout, n, ThreadPoolExecutor(2), alloc=cells.take)
    try:
        a = store.fetch(0, 1).result()
        want = a.gate.copy()
        b = store.fetch(0, 2).result()                          # a leaves the LRU; the caller still reads it
        assert list(store._lru) == [(0, 2)] and store.bytes == n and cells.live == 2
        c = store.fetch(0, 3).result()                          # b leaves too, and nobody holds it after `del`
        assert len({x.addr[0] for x in (a, b, c)}) == 3 and np.array_equal(a.gate, want)
        assert store.live_bytes == 3 * n
        del b
        gc.collect()
        assert cells.live == 2 and store.live_bytes == 2 * n
        d = store.fetch(0, 4).result()                          # b's cell comes back: no new chunk
        chunks = len(cells._chunks)
        assert chunks == 3 and np.array_equal(a.gate, want)
        del a, c, d
        gc.collect()
        assert store.live_bytes == store.bytes == n and cells.live == 1
        assert store.peak_bytes <= n and store.peak_live_bytes == 3 * n
    finally:
        store.close()


@pytest.mark.asyncio
async def test_budgets_hold_and_memory_is_accounted(tiny_gguf):
    """Under a RAM budget of a few blobs the LRU never holds more (its bytes are the blobs' own), every blob read
    for a step is freed once the step is done, and the PLE cache's arrays fit its budget."""
    mem = blob_mem(tiny_gguf)
    budget = 5 * mem + mem // 2
    async with Engine(load_model(tiny_gguf), host=HostConfig(host_budget_bytes=budget, ple_cache_bytes=10_000,
                                                             step_tokens=4)) as e:
        s = e.scheduler
        seen = []
        real = s.store._read

        def watched(layer, expert):
            blob = real(layer, expert)
            seen.append(s.store.bytes)
            return blob
        s.store._read = watched
        for _ in range(2):
            await e.score(TOKENS)
        await s.idle()
        assert max(seen) <= budget and s.store.peak_bytes <= budget and len(s.store) <= 5
        assert s.store.bytes == sum(b.mem_bytes for b in s.store._lru.values())
        assert s.store.reads > len(s.store)                   # evictions and re-reads happened
        # the CPU pool's thread hands a layer's result over before its wave's frame lets go of the batch (and
        # its blobs): a no-op queued behind the last wave has run once that frame is gone
        await asyncio.wrap_future(s.pool.threads.submit(lambda: None))
        gc.collect()
        assert s.store.live_bytes == s.store.bytes            # nothing outlives its step but the LRU
        assert s.store.peak_live_bytes > s.store.bytes        # ... while a step held one layer's misses
        assert s.ple.cache.nbytes <= 10_000 and s.ple.hits > 0


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["expert", "expert-stream", "ple", "ple-ahead"])
@pytest.mark.parametrize("direct", [True, False])
async def test_read_error_ends_the_affected_streams(where, direct, tiny_gguf, monkeypatch):
    """An EIO on an expert read (the SSD tier under the CPU pool, or under a streamed prompt chunk), a PLE row
    read, or a prompt's PLE rows read a step ahead: every stream of the step that needed it ends with an
    EngineError naming the file and the read, the store forgets the failed read, and the engine serves the same
    tokens as before."""
    host = HostConfig(host_budget_bytes=0, ple_cache_bytes=0, direct_io=direct, step_tokens=4,
                      stream_experts="always" if where == "expert-stream" else "never")
    if where == "expert-stream":          # the CPU twin of streamed prompt chunks
        model = load_model(tiny_gguf)
        e = Engine(model, backend=CpuBackend(model, stream=True), host=host)
    else:
        e = await Engine.open(tiny_gguf, host=host)
    prompts = [[3, 17, 500, 42, 99, 7, 311, 12, 260, 5, 88, 401, 23], [3, 500, 9, 9, 41]]
    try:
        s = e.scheduler
        assert s.store.file.direct == s.ple.file.direct == direct
        opened = []
        if where == "expert-stream":
            real_open = e.backend.stream_open
            e.backend.stream_open = lambda layer: (opened.append(layer), real_open(layer))
        expected = [await tokens_of(e, p) for p in prompts]
        assert bool(opened) == (where == "expert-stream")
        mod = experts_mod if where.startswith("expert") else ple_io
        real = mod.pread_into
        fail = {"on": where != "ple-ahead"}

        def failing(fd, buf, offset, path, what, *rest):
            if fail["on"]:
                raise OSError(errno.EIO, f"{path}: {what}: Input/output error (injected)")
            return real(fd, buf, offset, path, what, *rest)
        monkeypatch.setattr(mod, "pread_into", failing)
        if where == "ple-ahead":     # the step loop's second read: the long prompt's second chunk, read a step early
            calls, real_read = [], s.ple.read_rows

            def read_rows(rows):     # on the PLE thread, one read at a time in the order they were started
                calls.append(len(rows))
                fail["on"] = len(calls) == 2
                return real_read(rows)
            monkeypatch.setattr(s.ple, "read_rows", read_rows)
        results = await asyncio.gather(*(tokens_of(e, p) for p in prompts), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed and all(isinstance(r, EngineError) and isinstance(r.__cause__, OSError) for r in failed), \
            results
        assert all("Input/output error (injected)" in str(r) and str(tiny_gguf) in str(r) for r in failed)
        if where == "ple-ahead":              # the long prompt failed at its second chunk; the short one lived
            assert isinstance(results[0], EngineError) and "at position 4" in str(results[0])
            assert results[1] == expected[1]
        await s.idle()
        wait(list(s.store._pending.values()), timeout=30)     # the failed step's other reads run to their end
        assert s.live == 0 and not s.store._pending
        monkeypatch.setattr(mod, "pread_into", real)
        fail["on"] = False
        assert [await tokens_of(e, p) for p in prompts] == expected
    finally:
        await e.aclose()


async def tokens_of(e: Engine, prompt) -> list[int]:
    return [c.token async for c in e.generate(prompt, GREEDY) if c.token is not None]


@pytest.mark.asyncio
async def test_trace_counts_experts_by_tier(tiny_gguf, tmp_path, capsys):
    """Per step and layer the trace says how many of the distinct experts were VRAM hits, RAM-tier hits and SSD
    reads; the counts and bytes agree with the store's and the PLE reader's, the SSD time splits into parts that
    sum to it, and `cli.py trace` prints the tiers, the SSD figures and the peak RSS."""
    trace = tmp_path / "t.jsonl"
    budget = 40 * blob_mem(tiny_gguf)
    # no prefetch (the default, said here because the counts below need it): every read is a step's own
    async with Engine(load_model(tiny_gguf), trace=trace,
                      host=HostConfig(host_budget_bytes=budget, ple_cache_bytes=4096, prefetch="off")) as e:
        for p in ("Once upon a time", "Once upon a time"):
            await tokens_of(e, p)
        s = e.scheduler
        reads, ram_hits, ssd_bytes = s.store.reads, s.store.ram_hits, s.store.ssd_bytes
        ple_rows, ple_hits, ple_bytes = s.ple.rows_asked, s.ple.hits, s.ple.ssd_bytes
    recs = load(str(trace))
    assert recs
    for r in recs:
        for layer, routed, hits, cpu, fetched, _, _, ram, ssd in r["experts"]:
            assert hits == 0 and ram + ssd == cpu + fetched > 0               # the CPU backend holds none
        t = r["tiers"]
        assert t["ram"] == sum(x[7] for x in r["experts"]) and t["ssd"] == sum(x[8] for x in r["experts"])
        assert t["ssd_bytes"] == sum(x[1] for x in r["io"])
        assert 0 <= t["ssd_hidden_ms"] + t["ssd_exposed_ms"] <= t["ssd_ms"] + 2e-3      # each rounded to 1 us
        assert 0 < r["ple"][0] <= r["T"] * e.cfg.ple_heads and r["peak_rss"] > 0         # distinct rows
    assert sum(r["tiers"]["ssd"] for r in recs) == reads and sum(r["tiers"]["ram"] for r in recs) == ram_hits > 0
    assert sum(x[1] for r in recs for x in r["io"] if x[0] == "expert") == ssd_bytes
    assert sum(x[1] for r in recs for x in r["io"] if x[0] == "ple") == ple_bytes
    assert (sum(r["ple"][0] for r in recs), sum(r["ple"][1] for r in recs)) == (ple_rows, ple_hits)
    assert ple_hits > 0                                     # the second request's rows were cached
    for p in summarize(recs):
        assert p.io_busy_ms + p.io_host_ms + p.io_exposed_ms == pytest.approx(p.io_ms, abs=1e-9)
        assert p.peak_rss == max(r["peak_rss"] for r in recs if r["kind"] == p.phase)
    assert cli.main(["trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "tiers: distinct experts/step from VRAM" in out and "SSD:" in out and "kB/token" in out
    assert "exposed" in out and "peak RSS" in out and "from the RAM cache" in out


@pytest.mark.asyncio
async def test_preloaded_experts_are_ram_hits_with_no_reads_traced(tiny_gguf, tmp_path):
    """Blobs read before the steps (preload_experts) are RAM-tier hits in the steps that use them: no step counts
    an SSD read or carries an expert read's bytes or time."""
    trace = tmp_path / "t.jsonl"
    async with Engine(load_model(tiny_gguf), trace=trace, host=HostConfig(experts="host")) as e:
        await e.preload_experts()
        await tokens_of(e, "Once upon a time")
    recs = load(str(trace))
    assert all(r["tiers"]["ssd"] == 0 and r["tiers"]["ram"] > 0 for r in recs)
    assert not any(x[0] in ("expert", "ple") for r in recs for x in r["io"])      # the PLE table was preloaded too


def test_io_time_split():
    io = [(0.0, 4.0), (6.0, 8.0)]
    busy = [(1.0, 2.0), (7.0, 9.0)]
    waits = [(3.0, 6.5)]
    assert subtract(io, busy) == [(0.0, 1.0), (2.0, 4.0), (6.0, 7.0)]
    assert subtract(io, []) == io and subtract([], busy) == []
    hidden, host, exposed = split_io(io, busy, waits)
    assert (hidden, exposed, host) == pytest.approx((2.0, 1.5, 2.5))          # sums to the 6 ms in flight


def test_aligned_spans():
    reads, at = spans([(5000, 100), (4000, 200), (20000, 10)])
    # 4000..4200 and 5000..5100 share block 0..8192 (one read); 20000 needs block 16384..20480
    assert reads == [(0, 8192, 0), (16384, 4096, 8192)]
    assert at == [5000, 4000, 8192 + 20000 - 16384]
    reads, at = spans([(8192, 4096)])
    assert reads == [(8192, 4096, 0)] and at == [0]
    buf = aligned_empty(3 * ALIGN)
    assert buf.ctypes.data % ALIGN == 0 and buf.nbytes == 3 * ALIGN


def test_row_cache_is_lru_within_a_set_and_fits_its_budget():
    c = RowCache(budget_bytes=(10 + 16) * RowCache.WAYS * 2, row_bytes=10)        # 2 sets of 8 ways
    assert c.n_sets == 2 and c.nbytes <= (10 + 16) * 16
    raw = lambda rows: np.repeat(np.asarray(rows, np.uint8)[:, None], 10, axis=1)
    out = np.zeros((3, 10), np.uint8)
    rows = np.array([0, 2, 4])                                          # all in set 0
    assert not c.get(rows, out).any()
    c.put(rows, raw(rows))
    assert c.get(rows, out).all() and np.array_equal(out, raw(rows))
    c.put(np.arange(6, 16, 2), raw(np.arange(6, 16, 2)))                # five more in set 0, one call: full
    assert c.get(np.arange(0, 16, 2), np.zeros((8, 10), np.uint8)).all()
    c.get(np.array([0, 4]), out[:2])                                    # 2 is now set 0's least recent
    c.put(np.array([100]), raw([100]))
    hit = c.get(np.array([0, 2, 4, 100, 1]), np.zeros((5, 10), np.uint8))
    assert hit.tolist() == [True, False, True, True, False]
    c.put(np.arange(1, 40, 2), raw(np.arange(1, 40, 2)))                # 20 new rows of set 1: 8 are kept
    assert c.get(np.arange(1, 40, 2), np.zeros((20, 10), np.uint8)).sum() == RowCache.WAYS
    assert RowCache(0, 10).n_sets == 0 and not RowCache(0, 10).get(rows, out).any()


def test_refused_o_direct_falls_back_with_one_note(tiny_gguf, monkeypatch, caplog):
    monkeypatch.setattr(direct_io, "_noted", set())
    refuse_o_direct(monkeypatch)
    with caplog.at_level(logging.INFO, logger="strata.io"):
        a, b = open_file(str(tiny_gguf)), open_file(str(tiny_gguf))
    try:
        assert not a.direct and "refused O_DIRECT (EINVAL)" in a.mode
        assert [r.getMessage() for r in caplog.records].count(
            f"strata: {tiny_gguf}: the filesystem refused O_DIRECT (EINVAL); reading with buffered pread, the page "
            f"cache holds what is read") == 1
    finally:
        a.close()
        b.close()
    f = open_file(str(tiny_gguf), direct=False)
    assert not f.direct and f.mode == "buffered pread (direct I/O off)"
    f.close()


def test_a_failing_first_read_names_the_file(tiny_gguf, monkeypatch):
    """An I/O error (not a refusal of O_DIRECT) in open_file's probe read is the file's error, named."""
    def fail(*args):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(direct_io.os, "preadv", fail)
    with pytest.raises(OSError, match=f"{tiny_gguf}: reading its first block: Input/output error"):
        open_file(str(tiny_gguf))


@pytest.mark.asyncio
async def test_open_line_says_tiers_reads_and_peak_rss(tiny_gguf):
    lines = []
    async with await Engine.open(tiny_gguf, host=HostConfig(host_budget_bytes=1 << 20), log=lines.append) as e:
        assert lines == [e.open_line]
    assert lines[0].startswith(f"opened {tiny_gguf}: experts: 0 VRAM slots, RAM tier 0.00 GiB")
    assert "PLE table in RAM 0 MiB" in lines[0] and "reads: O_DIRECT" in lines[0] and "), peak " in lines[0]
    async with await Engine.open(tiny_gguf, host=HostConfig(ple_cache_bytes=64 << 10), log=lines.append) as e:
        assert "PLE hot-row cache 0 MiB" in e.open_line                  # 64 KiB: less than the table


@pytest.mark.asyncio
async def test_a_large_ple_table_is_announced_before_it_is_read(tiny_gguf, monkeypatch):
    import strata.host.scheduler as sched_mod
    monkeypatch.setattr(sched_mod, "PLE_ANNOUNCE", 1)            # tiny's table: "large" for this test
    lines = []
    async with await Engine.open(tiny_gguf, log=lines.append) as e:
        assert len(lines) == 2 and lines[1] == e.open_line and e.scheduler.ple.table is not None
        assert lines[0].startswith("reading the PLE table whole into RAM") and "--ple-cache-mib 64" in lines[0]


def test_a_read_error_in_the_whole_table_fails_the_open_and_releases_it(tiny_gguf, monkeypatch):
    """The PLE table read at open fails: the open raises an OSError naming the file, the backend and the
    scheduler's pools and files are closed; the next open works."""
    closed = []
    at = load_model(tiny_gguf).file.tensor("per_layer_token_embd.weight").offset
    real = os.preadv

    def fail(fd, bufs, offset):                                    # the read that covers the table's first byte
        if offset <= at < offset + sum(len(b) for b in bufs):
            raise OSError(5, "Input/output error (injected)")
        return real(fd, bufs, offset)
    monkeypatch.setattr(direct_io.os, "preadv", fail)               # under pread_into, which names the file
    monkeypatch.setattr(CpuBackend, "close", lambda self: closed.append(self))
    with pytest.raises(OSError, match=f"{tiny_gguf}: reading the PLE table .*Input/output error"):
        Engine.open_sync(tiny_gguf)
    assert len(closed) == 1
    monkeypatch.undo()
    e = Engine.open_sync(tiny_gguf)
    assert e.scheduler.ple.table is not None
    e.close()


def test_cli_tier_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--host-budget-gib" in out and "(default: every expert, at most half the RAM)" in out
    assert "--ple-cache-mib MIB|auto" in out and "(default: auto)" in out
    seen = {}

    class Stop(Exception):
        pass

    def fake_open(*args, **kw):
        seen.update(kw)
        raise Stop
    import strata.engine
    orig = strata.engine.Engine.open_sync
    strata.engine.Engine.open_sync = fake_open
    try:
        with pytest.raises(Stop):
            cli.main(["chat", "--host-budget-gib", "0.5", "--ple-cache-mib", "0"])
    finally:
        strata.engine.Engine.open_sync = orig
    assert seen["host"].host_budget_bytes == 1 << 29 and seen["host"].ple_cache_bytes == 0 and seen["log"]


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["previous", "router"])
async def test_prefetch_reads_the_likely_experts(tiny_gguf, tmp_path, how):
    """HostConfig.prefetch: with a RAM tier too small for the experts, each layer's likely experts (its experts of
    the previous step, or its router's top k over the layer before's MoE input) are read while the layer before runs; the logits are the same as without it, the trace counts the reads it
    started and the misses it predicted, and every store read is a step's own or one the prefetch started."""
    trace = tmp_path / "t.jsonl"
    budget = 2 * blob_mem(tiny_gguf)                # a step's blobs do not stay: the previous step's are read again
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 500, 24)]
    got = {}
    for mode in ("off", how):
        async with Engine(load_model(tiny_gguf), trace=trace if mode == how else None,
                          host=HostConfig(host_budget_bytes=budget, prefetch=mode, experts="host",
                                          step_tokens=1)) as e:
            got[mode] = np.asarray(await e.scheduler.score(tokens))     # one token a step: decode's pattern
            s = e.scheduler
            assert s.prefetch_on == (mode == how)
            reads = s.store.reads
    assert np.array_equal(got[how], got["off"])
    recs = load(str(trace))
    started, misses, predicted = (sum(r["prefetch"][i] for r in recs) for i in range(3))
    assert started > 0 and 0 < predicted <= min(started, misses)
    ssd = sum(r["tiers"]["ssd"] for r in recs)
    assert ssd <= reads <= ssd + started
    with pytest.raises(ValueError, match="prefetch"):
        HostConfig(prefetch="sometimes")
