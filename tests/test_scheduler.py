"""The token loop over the CPU backend: its logits equal the reference's teacher-forced logits exactly, token by
token, through every expert path (CPU pool, VRAM cache hits, uploads, host-memory evictions); the one-layer-stale
expert mistake fails that check; the cache policy and cost split behave."""

from __future__ import annotations

import time

import numpy as np
import pytest
import pytest_asyncio

from strata.engine import Engine
from strata.host.cells import Cells, numpy_chunks
from strata.host.backend import CpuBackend, ExpertPlan, _Copy
from strata.host.scheduler import EngineError
from strata.host.experts import CpuExpertPool, ExpertBlob, ExpertSlice, MissCosts, VramCache
from strata.host.scheduler import HostConfig, Scheduler
from strata.model.loader import load_model
from strata.model.weights import Mat
from strata.quant import QType, random_blocks, row_bytes
from strata.reference.moe import expert_ffn

# tiny preset: vocab 512, EOS 500; EOS mid-sequence (twice back to back) cuts the PLE n-grams
TOKENS = [3, 17, 500, 42, 99, 500, 500, 7, 311, 12, 260, 5, 88, 401, 23, 64]


@pytest.fixture(scope="module")
def realistic_gguf(tmp_path_factory):
    """The tiny geometry in the realistic type mix: Q2_0 gate/up experts, Q8_0 down, BF16 PLE table."""
    from strata.model.synth import make_model
    path = tmp_path_factory.mktemp("tiny-realistic") / "tiny.gguf"
    make_model("tiny", path, seed=1, mix="realistic", log=lambda s: None)
    return path


class VramOnCpu(CpuBackend):
    """The CPU backend with an expert cache (CpuBackend's twin of the VRAM cache, cache_slots): uploaded blobs are
    computed from the uploaded bytes, as a GPU computes its hits, so a wrong slice or slot changes the logits;
    `where` is its slot map."""

    def __init__(self, model, slots: int, stream: bool = False, batch_slots: int = 0):
        super().__init__(model, stream=stream, cache_slots=slots, batch_slots=batch_slots)

    @property
    def where(self) -> dict[tuple[int, int], int]:
        return {o: i for i, o in enumerate(self._owner) if o is not None}


class CellsOnCpu(VramOnCpu):
    """VramOnCpu whose expert blobs live in host_alloc's cells (as the CUDA backend's pinned ones do): every upload
    must come from a cell, and a cell evicted from the store is reused only once nothing reads it."""

    def __init__(self, model, slots: int):
        super().__init__(model, slots)
        self.cells = Cells(1, numpy_chunks, chunk_bytes=1)        # one cell per chunk: reuse shows in nbytes

    def host_alloc(self, nbytes):
        if nbytes > self.cells.cell_bytes:
            self.cells = Cells(nbytes, numpy_chunks, chunk_bytes=1)
        return self.cells.take(nbytes)

    def load_expert(self, layer, expert, slot, gate, up, down):
        assert all(self.cells.owns(m) for m in (gate, up, down)), "an uploaded blob is not in a cell"
        super().load_expert(layer, expert, slot, gate, up, down)


class QueuedOnCpu(VramOnCpu):
    """VramOnCpu whose uploads are queued as the CUDA backend's are (load_expert owns the slot at once; the bytes
    land at loads_done, or at the next post or mapped token, which send what is left): until then the slot holds
    0xFF bytes, so a post that read it early would break the logits. left_at_launch counts the loads a launch had
    to send itself, the ones the host did not send when it was done uploading."""

    def __init__(self, model, slots: int):
        super().__init__(model, slots)
        self.queued: list[tuple[int, object]] = []
        self.left_at_launch = self.done_calls = 0

    def load_expert(self, layer, expert, slot, gate, up, down):
        super().load_expert(layer, expert, slot, gate, up, down)
        self.queued.append((slot, self._slot_copy[slot]))
        self._slot_copy[slot] = _Copy(*(np.full_like(v, 0xFF) for v in (gate, up, down)))

    def loads_done(self):
        self.done_calls += 1
        for slot, copy in self.queued:
            if self._slot_copy[slot] is not None:
                self._slot_copy[slot] = copy
        self.queued = []

    def _send_left(self):
        self.left_at_launch += len(self.queued)
        self.loads_done()
        self.done_calls -= 1

    def launch_post(self, plan):
        self._send_left()
        return super().launch_post(plan)

    def launch_whole(self, step, e):
        self._send_left()
        return super().launch_whole(step, e)


class WholeOnCpu(CpuBackend):
    """The CPU twin of CudaBackend(experts="vram"): every expert resident, a step is one job (the whole-step
    graph) fed the PLE rows the scheduler read; no per-layer round trip may happen."""
    graphs = True

    def __init__(self, model):
        super().__init__(model, experts="mapped")
        self.experts = "vram"                # what the scheduler's whole-step path looks for

    def resident(self, layer, experts):
        return np.ones(len(experts), bool)

    def launch_pre(self, layer):
        raise AssertionError("the whole-step path launched a per-layer graph")

    def launch_whole(self, step, e):
        if self.cfg.ple_layers and e is None:
            raise AssertionError("launch_whole without the step's PLE rows")
        self.begin(step)

        def step_graph():
            R = self.R
            for il in range(self.cfg.n_layer):
                p = self.ref.pre(self.batch, il, R, e if il in self.cfg.ple_layers else None)
                R = self.ref.post(self.batch, il, p, self.ref.experts(il, p.x, p.ids))
            logits = self.ref.head(self.batch, R, step.logit_rows.tolist())
            self.ref.finish(self.batch)
            return logits
        self._run(step_graph)


async def assert_parity(sched: Scheduler, ref: Engine, tokens: list[int]) -> None:
    got, want = await sched.score(tokens), ref.logits(tokens, chunk=1)
    for i in range(len(tokens)):
        assert np.array_equal(got[i], want[i]), \
            f"position {i}: logits differ by up to {np.abs(got[i] - want[i]).max():.3g}"


@pytest_asyncio.fixture
async def tiny_sched(tiny_gguf):
    model = load_model(tiny_gguf)
    sched = Scheduler(model, CpuBackend(model))
    yield sched
    await sched.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("mix,exact", [("f32", False), ("realistic", False), ("realistic", True)])
async def test_loop_logits_equal_teacher_forced(mix, exact, tiny_gguf, realistic_gguf):
    path = tiny_gguf if mix == "f32" else realistic_gguf
    model = load_model(path, exact=exact)
    sched = Scheduler(model, CpuBackend(model), exact=exact)
    try:
        await assert_parity(sched, Engine.open_sync(path, exact=exact), TOKENS)
        assert sched.store.reads > 0 and sched.cache.hit_rate() == 0.0   # every expert went through the pool
    finally:
        await sched.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("mix,exact", [("f32", False), ("realistic", False), ("realistic", True)])
async def test_mapped_experts_keep_parity(mix, exact, tiny_gguf, realistic_gguf):
    """CpuBackend(experts="mapped") computes every routed expert itself from the mapped file: the logits equal the
    teacher-forced reference's exactly, and the host reads no expert and runs none on its pool."""
    path = tiny_gguf if mix == "f32" else realistic_gguf
    model = load_model(path, exact=exact)
    sched = Scheduler(model, CpuBackend(model, experts="mapped"), exact=exact)
    try:
        await assert_parity(sched, Engine.open_sync(path, exact=exact), TOKENS)
        assert sched.store.reads == 0 and sched.cache.hit_rate() == 1.0
    finally:
        await sched.aclose()
    with pytest.raises(ValueError, match="experts='vram'"):
        CpuBackend(model, experts="vram")


@pytest.mark.asyncio
@pytest.mark.parametrize("slots,budget_blobs,host_blobs,cells", [(6, 5, None, False), (3, 3, 2, False),
                                                                  (64, 64, None, False), (3, 3, 2, True),
                                                                  (6, 5, None, "queued")])
async def test_vram_cache_paths_keep_parity(slots, budget_blobs, host_blobs, cells, realistic_gguf):
    """Hits, uploads, evictions (a cache smaller than one layer's routing included) and a host store that must
    re-read blobs: the logits stay exact. How misses split depends on measured costs (timing); the first miss
    of each layer is always uploaded (to measure the path), so uploads happen, and with room for every expert
    (64 slots) nothing is evicted and hits must follow."""
    model = load_model(realistic_gguf)
    sched0 = Scheduler(model, CpuBackend(model))
    blob = sched0.layout.blob_bytes(0)
    await sched0.aclose()
    host = HostConfig(vram_budget_bytes=budget_blobs * blob, step_tokens=5,    # several steps: hits can follow
                      host_budget_bytes=None if host_blobs is None else host_blobs * blob)
    backend = {True: CellsOnCpu, False: VramOnCpu, "queued": QueuedOnCpu}[cells](model, slots)
    sched = Scheduler(model, backend, host)
    try:
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS + TOKENS[:8])
        if cells == "queued":     # the host sent every layer's uploads when it was done with them
            assert backend.done_calls > 0 and backend.left_at_launch == 0
        elif cells:   # blobs were evicted and re-read, yet cells were reused: fewer chunks than reads
            assert len(backend.cells._chunks) < sched.store.reads
            assert backend.cells.live <= host_blobs + slots + 16
        assert sched.cache.uploads > 0 and (sched.cache.hit_rate() > 0 or slots < 64)
        assert len(sched.cache) <= min(slots, budget_blobs) and sched.cache.bytes <= budget_blobs * blob
        assert any(c is not None for c in sched.costs.cpu_ms) and any(u is not None for u in sched.costs.upload_ms)
        if host_blobs is not None:
            assert len(sched.store) <= host_blobs and sched.store.reads > len(sched.store)
    finally:
        await sched.aclose()


@pytest.mark.asyncio
async def test_whole_token_path_keeps_parity(realistic_gguf):
    """Every expert resident: the scheduler runs one job per token (PLE rows read by the host, as on the GPU),
    with the same logits and a trace of token spans only."""
    model = load_model(realistic_gguf)
    sched = Scheduler(model, WholeOnCpu(model))
    try:
        assert sched.whole
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS)
        assert sched.store.reads == 0
    finally:
        await sched.aclose()


class StaleScheduler(Scheduler):
    """The seed's bug, injected: post[l] gets the plan made for the previous layer (one layer stale); `relabel`
    also gives that stale plan this layer's number, so only the numbers can show the mistake."""
    held = None
    relabel = False

    async def _expert_plan(self, il, route, st):
        plan = await super()._expert_plan(il, route, st)
        stale, self.held = self.held, plan
        if stale is None:
            return plan
        if self.relabel:
            stale = ExpertPlan(il, plan.experts, plan.offsets, plan.pairs, plan.resident, stale.parts)
        return stale


@pytest.mark.asyncio
@pytest.mark.parametrize("relabel", [False, True])
async def test_stale_experts_fail(relabel, tiny_gguf):
    """A plan carries its layer and the backend checks it; a stale plan passed off as this layer's fails parity."""
    model, ref = load_model(tiny_gguf), Engine.open_sync(tiny_gguf)
    sched = Scheduler(model, CpuBackend(model))
    try:
        await assert_parity(sched, ref, TOKENS[:6])
    finally:
        await sched.aclose()
    sched = StaleScheduler(model, CpuBackend(model))
    sched.relabel = relabel
    try:
        if relabel:
            with pytest.raises(AssertionError, match="logits differ"):
                await assert_parity(sched, ref, TOKENS[:6])
        else:
            with pytest.raises(EngineError, match="a plan for layer 0, the step is at layer 1"):
                await assert_parity(sched, ref, TOKENS[:6])
    finally:
        await sched.aclose()


@pytest.mark.asyncio
async def test_prompt_reads_run_ahead(tiny_gguf):
    """A prompt's next chunk's PLE rows are read a whole step early: chunk i+1's read starts before step i
    begins, each chunk is read once, and a step's rows are read deduplicated in one batch."""
    model = load_model(tiny_gguf)
    sched = Scheduler(model, CpuBackend(model), HostConfig(step_tokens=4))
    log = []
    be, ple = sched.backend, sched.ple
    real_start, real_begin = ple.start, be.begin
    ple.start = lambda rows, **kw: (log.append(("read", len(rows), len(set(rows.tolist())))),
                                    real_start(rows, **kw))[1]
    be.begin = lambda step, **kw: (log.append(("begin", step.T)), real_begin(step, **kw))[1]
    try:
        await assert_parity(sched, Engine.open_sync(tiny_gguf), TOKENS[:10] + [TOKENS[1]] * 4)   # 3 chunks
    finally:
        await sched.aclose()
    kinds = [x[0] for x in log]
    assert kinds == ["read", "read", "begin", "read", "begin", "read", "begin", "begin"], kinds
    assert all(n == distinct for _, n, distinct in (x for x in log if x[0] == "read"))
    assert [x[1] for x in log if x[0] == "begin"] == [4, 4, 4, 2]


@pytest.mark.asyncio
async def test_decode_reads_run_ahead(tiny_gguf):
    """A decode row's PLE rows start reading as soon as its token is sampled, before the step that sampled it ends
    (its trace is emitted); the last token, which needs no next row, starts none."""
    from strata.sampling import SamplingParams
    model = load_model(tiny_gguf)
    sched = Scheduler(model, CpuBackend(model), HostConfig(step_tokens=4))
    log = []
    ple, tracer = sched.ple, sched.tracer
    real_start, real_emit = ple.start, tracer.emit
    ple.start = lambda rows, **kw: (log.append("read"), real_start(rows, **kw))[1]
    tracer.emit = lambda st: (log.append("end"), real_emit(st))[1]
    try:
        req = sched.submit([3, 17, 42], SamplingParams(max_tokens=4, stop_at_eos=False))
        got = []
        while True:
            ev = await req.next()
            if getattr(ev, "token", None) is not None:
                got.append(ev.token)
            if type(ev).__name__ == "Finished":
                break
    finally:
        await sched.aclose()
    assert len(got) == 4
    assert log == ["read", "read", "end", "read", "end", "read", "end", "end"], log


@pytest.mark.asyncio
async def test_requests_leave_no_state(tiny_sched):
    for n in (1, 3):
        await tiny_sched.score(TOKENS[:n])
    await tiny_sched.idle()
    assert tiny_sched.live == 0 and tiny_sched.backend.live == 0


class SlowCpu(CpuBackend):
    """The CPU backend with every stage 20 ms long and a count of doorbell polls; `wake` False hides in_flight, so
    the scheduler polls it as it polls a GPU."""

    def __init__(self, model, wake: bool):
        super().__init__(model)
        self.polls = 0
        if not wake:
            self.in_flight = None

    def _run(self, fn, *args, **kw):
        super()._run(lambda: (time.sleep(0.02), fn(*args))[1], **kw)

    def poll_route(self, layer):
        self.polls += 1
        return super().poll_route(layer)


@pytest.mark.asyncio
@pytest.mark.parametrize("wake", [True, False])
async def test_thread_device_wakes_the_loop(wake, tiny_gguf):
    """A device that is a thread of this process (in_flight gives the stage's future) is awaited: one poll when the
    stage is launched and one when it ends, not a spin that would hold the GIL that thread needs. The logits stay
    the reference's either way."""
    model = load_model(tiny_gguf)
    be = SlowCpu(model, wake)
    sched = Scheduler(model, be)
    try:
        await assert_parity(sched, Engine.open_sync(tiny_gguf), TOKENS[:2])
    finally:
        await sched.aclose()
    per_stage = be.polls / (sched._steps * model.cfg.n_layer)
    assert per_stage == 2 if wake else per_stage > 10, per_stage


def test_miss_split_follows_measured_costs():
    c = MissCosts(2)
    one = np.ones(5, np.int64)                              # five misses serving one row each
    assert c.n_upload(0, one, can_upload=False) == 0
    assert c.n_upload(0, one, True) == 1                    # uploads unmeasured: one, to measure
    c.observe_upload(0, 1, 0.004)                           # 4 ms per upload
    assert c.n_upload(0, one, True) == 4                    # CPU unmeasured: it gets one
    c.observe_cpu(0, 2, 0.002)                              # 1 ms per (row, expert) pair on the CPU
    assert c.n_upload(0, one, True) == 1                    # max(4 x 1, 1 x 4) beats every other split
    # a prompt chunk: the most-used misses go up first, their rows leave the CPU's share
    assert c.n_upload(0, np.array([40, 30, 2, 1, 1]), True) == 2     # max(4 x 1, 2 x 4) = 8 beats 36 and 12
    for _ in range(40):
        c.observe_cpu(0, 1, 0.016)                          # the CPU slows to 16 ms: estimates follow
    assert c.n_upload(0, one, True) == 4
    assert c.n_upload(1, one[:0], True) == 0


def test_vram_cache_policy():
    cache = VramCache(slots=3, budget_bytes=250, n_layer=2, n_expert=16)
    assert cache.place(0, 1, 100, keep={1, 2}) is not None
    assert cache.place(0, 2, 100, keep={1, 2}) is not None
    assert cache.place(0, 3, 100, keep={1, 2, 3}) is None                  # the budget, and both are in use
    cache.record(1, np.array([7]), np.array([False]), np.array([1]))
    assert cache.place(1, 7, 100, keep={7}) is not None                    # layer 0's experts may go now
    assert len(cache) == 2 and cache.bytes == 200
    assert (0, 1) not in cache._lru and (0, 2) in cache._lru                # least recently used went first
    cache.record(0, np.array([2, 5]), np.array([True, False]), np.array([3, 1]))
    assert cache.hits[0] == 3 and cache.lookups[0] == 4 and cache.lookups[1] == 1      # counted per pair
    assert cache.place(0, 9, 300, keep=set()) is None                      # larger than the whole budget


def test_vram_cache_ranks_by_decayed_routes():
    """popularity(): routes counted with the half-life (a route half_life tokens old counts half); a ranked
    placement evicts the least recently used expert only when that one is less popular than the newcomer."""
    cache = VramCache(slots=2, budget_bytes=1 << 20, n_layer=2, n_expert=8, half_life=4)
    cache.record(0, np.array([1, 2]), np.array([False, False]), np.array([3, 1]))
    cache.tick(4)
    cache.count_token(np.array([[1, 3], [5, 6]]), np.zeros((2, 2), bool))
    assert cache.popularity(0, 1) == pytest.approx(3 / 2 + 1)       # 3 routes a half-life ago, 1 now
    assert cache.popularity(0, 2) == pytest.approx(0.5) and cache.popularity(1, 5) == pytest.approx(1.0)
    assert cache.place(0, 2, 1, set()) is not None and cache.place(0, 1, 1, set()) is not None
    assert cache.place(1, 5, 1, set(), ranked=True) is not None         # 1.0 > (0, 2)'s 0.5: it goes
    assert (0, 2) not in cache._lru and (1, 5) in cache._lru
    assert cache.place(0, 3, 1, set(), ranked=True) is None             # 1.0 against (0, 1)'s 2.5: nothing moves
    assert list(cache._lru) == [(0, 1), (1, 5)]
    assert cache.place(0, 3, 1, set()) is not None                      # unranked, as an upload: LRU
    assert (0, 1) not in cache._lru
    for _ in range(10 ** 4):                                            # far past float64 without the rescale
        cache.tick(4 * 1000)
    assert np.isfinite(cache.score).all() and cache.popularity(0, 3) == 0.0
    with pytest.raises(ValueError, match="half-life"):
        VramCache(1, 1, 1, 1, half_life=0)


def test_vram_cache_withdraw_restore():
    """Slots withdrawn for a step of several rows (the lent stream buffers and activations, any set of them):
    their experts leave the cache and its bytes, no placement takes them meanwhile, evicting only the other slots,
    and once restored they are the last free slots taken."""
    cache = VramCache(slots=5, budget_bytes=1 << 20, n_layer=1, n_expert=16)
    for e in range(4):
        assert cache.place(0, e, 10, set()) == e                        # the lowest free slot first
    assert cache.withdraw([3, 4]) == [(0, 3)] and len(cache) == 3 and cache.bytes == 30
    assert [cache.place(0, e, 10, set(), evict=False) for e in (8, 9)] == [None, None]
    assert cache.place(0, 8, 10, set()) in (0, 1, 2) and (0, 0) not in cache._lru    # evicts the LRU, not slot 3/4
    cache.restore()
    cache.restore()                                                     # a second restore changes nothing
    assert sorted(cache._free) == [3, 4] and cache.place(0, 10, 10, set()) in (3, 4)
    cache.withdraw([0])
    cache.restore()
    assert cache._free[0] == 0 and len(cache._free) == 2                # the restored slot goes last
    held = {k: slot for k, (slot, _) in cache._lru.items()}
    gone = cache.withdraw(np.array([4, 1]))                             # any set of slots, not only a range
    assert sorted(gone) == sorted(k for k, slot in held.items() if slot in (1, 4))
    assert all(slot not in (1, 4) for slot, _ in cache._lru.values()) and not {1, 4} & set(cache._free)
    free = list(cache._free)
    cache.restore()
    assert cache._free == [4, 1] + free                                 # taken after every other free slot


@pytest.mark.parametrize("n_experts,threads", [(1, 4), (3, 8), (5, 2)])
def test_cpu_pool_row_splits_match_reference(n_experts, threads):
    """Experts of the real geometry (Q2_0, F 640, E 2560), each over its own rows of a step, split over rows and
    threads give exactly the reference expert's output on those rows; blobs that arrive late (reads still
    running) are waited for."""
    from concurrent.futures import Future
    rng = np.random.default_rng(n_experts)
    E, F, T = 2560, 640, 6
    gate = ExpertSlice(QType.Q2_0, F, E, row_bytes(QType.Q2_0, E), 0, 0)
    down = ExpertSlice(QType.Q2_0, E, F, row_bytes(QType.Q2_0, F), 0, 0)
    slices = (gate, gate, down)
    blobs, futs = [], []
    for e in range(n_experts):
        b = ExpertBlob(0, e, slices)
        for view, s in zip((b.gate, b.up, b.down), slices):
            view[:] = random_blocks(QType.Q2_0, (s.rows, s.n_in), rng, 1 / np.sqrt(s.n_in))
        blobs.append(b)
        futs.append(Future())
    X = rng.normal(size=(T, E)).astype(np.float32)
    rows = [np.sort(rng.choice(T, size=1 + e % T, replace=False)) for e in range(n_experts)]
    pool = CpuExpertPool(threads, exact=False)
    try:
        job = pool.run(slices, X, futs, np.cumsum([0] + [len(r) for r in rows]), np.concatenate(rows))
        for f, b in zip(futs, blobs):
            f.set_result(b)
        res = job.result(timeout=60)
    finally:
        pool.close()
    for j, b in enumerate(blobs):
        mats = [Mat("m", QType.Q2_0, raw, s.rows, s.n_in) for raw, s in zip((b.gate, b.up, b.down), slices)]
        got = res.parts[res.offsets[j]:res.offsets[j + 1]]
        assert np.array_equal(got, expert_ffn(*mats, X[rows[j]])), f"expert {j}"


@pytest.mark.asyncio
@pytest.mark.parametrize("whole", [False, True])
async def test_a_steps_deliveries_follow_the_next_launch(whole, realistic_gguf, tmp_path, monkeypatch):
    """A decode token reaches its stream after the next step's first launch (the step's tail runs while the
    device computes); the stream still carries every token in order, then the end, and the trace has the tail's
    spans with the step's parts summing to its wall."""
    import asyncio

    from strata.host.trace import load, summarize
    from strata.sampling import SamplingParams
    model = load_model(realistic_gguf)
    log: list[tuple] = []
    base = WholeOnCpu if whole else CpuBackend

    class Logged(base):
        def launch_pre(self, layer):
            if layer == 0:
                log.append(("launch",))
            return super().launch_pre(layer)

        def launch_whole(self, step, e):
            log.append(("launch",))
            return super().launch_whole(step, e)
    n = 6
    ref = Engine.open_sync(realistic_gguf)
    want = [c async for c in ref.generate([3, 17, 42], SamplingParams(max_tokens=n, stop_at_eos=False))]
    await ref.aclose()
    real_put = asyncio.Queue.put_nowait
    monkeypatch.setattr(asyncio.Queue, "put_nowait",
                        lambda q, ev: (log.append(("put", type(ev).__name__)), real_put(q, ev))[1])
    path = tmp_path / "t.jsonl"
    eng = Engine(model, backend=Logged(model), trace=path)
    try:
        assert eng.scheduler.whole == whole
        got = [c async for c in eng.generate([3, 17, 42], SamplingParams(max_tokens=n, stop_at_eos=False))]
    finally:
        await eng.aclose()
    assert [c.token for c in got] == [c.token for c in want] and len(got) == n + 1 and got[-1].finish_reason
    steps = [i for i, e in enumerate(log) if e == ("launch",)]
    puts = [i for i, e in enumerate(log) if e == ("put", "TokenOut")]
    assert len(puts) == n and log.index(("put", "Finished")) > puts[-1]
    assert len(steps) == n         # the prompt's step (its logits give token 0), then n - 1 decode steps
    for k in range(n - 1):         # token k, sampled from step k's logits, reaches the stream after launch k + 1
        assert steps[k + 1] < puts[k] < (steps[k + 2] if k + 2 < n else len(log)), (k, log)
    recs = [r for r in load(str(path)) if r["kind"] == "decode"]
    assert sum(1 for r in recs for s in r["spans"] if s[0] == "tail") >= n - 2
    for p in summarize(recs):
        assert sum(v for k, v in p.ms.items() if k != "total") == pytest.approx(p.ms["total"], rel=1e-6)
