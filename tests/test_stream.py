"""Streaming a step's experts (HostConfig.stream_experts): every expert a layer lacks in VRAM is copied into the
backend's stream buffer while the layer before computes, and post computes the routed ones from there. On the
CPU twin (CpuBackend's stream buffers, computed with the CPU pool's compiled batch) the logits equal the
teacher-forced reference's exactly, with and without cache hits used in place; the double buffer's protocol is
checked; the choice by measured cost; a failed read ends only that step's requests."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from strata.engine import Engine
from strata.host.backend import BackendError, CpuBackend, ExpertPlan, Segment, Step
from strata.host.experts import ExpertLayout
from strata.host.scheduler import HostConfig, Scheduler, _size_class
from strata.model.loader import load_model
from strata.reference.ple import NgramWindow, ple_gather, ple_rows
from test_scheduler import TOKENS, VramOnCpu, assert_parity, realistic_gguf  # noqa: F401  (its fixture)


class Counting(CpuBackend):
    """CpuBackend recording which layers each step streamed."""

    def __init__(self, model):
        super().__init__(model, stream=True)
        self.opened: list[tuple[int, int]] = []           # (step T, layer)

    def stream_open(self, layer):
        super().stream_open(layer)
        self.opened.append((self.step.T, layer))


class StreamVramOnCpu(VramOnCpu):
    """The CPU twin with a cache and stream buffers: resident experts come from the cache's slot copies, the other
    ones from the stream (both computed from the bytes the host handed over)."""

    def __init__(self, model, slots: int, batch_slots: int = 0):
        super().__init__(model, slots, stream=True, batch_slots=batch_slots)


@pytest.mark.asyncio
@pytest.mark.parametrize("mix,exact", [("f32", False), ("realistic", False), ("realistic", True)])
async def test_streamed_steps_keep_parity(mix, exact, tiny_gguf, realistic_gguf):
    """Prompt chunks of 5 rows stream every layer's experts (stream_experts="always"); a 1-row step never does."""
    path = tiny_gguf if mix == "f32" else realistic_gguf
    model = load_model(path, exact=exact)
    be = Counting(model)
    sched = Scheduler(model, be, HostConfig(step_tokens=5, stream_experts="always"), exact=exact)
    try:
        await assert_parity(sched, Engine.open_sync(path, exact=exact), TOKENS)     # steps of 5, 5, 5, 1 rows
        n = model.cfg.n_layer
        assert be.opened == [(5, il) for _ in range(3) for il in range(n)]
        assert sched.pool.threads._work_queue.qsize() == 0 and sched.store.reads > 0
    finally:
        await sched.aclose()


@pytest.mark.asyncio
async def test_streaming_uses_cache_hits_in_place(realistic_gguf):
    """A cache filled by 1-row steps (uploads) stays as it is through streamed chunks: only the experts a layer
    lacks are streamed, the cached ones are computed from their slots, and the logits stay exact."""
    model = load_model(realistic_gguf)
    blob = ExpertLayout.from_model(model).blob_bytes(0)
    be = StreamVramOnCpu(model, 12)
    streamed: list[int] = []
    real = be.stream_experts

    def spy(layer, items):
        for expert, *_ in items:
            streamed.append((layer, expert))
            assert (layer, expert) not in be.where, "a cached expert was streamed"
        real(layer, items)

    # the cache is full after the one-row steps: a streamed chunk finds no free slot, so it evicts nothing
    be.stream_experts = spy
    sched = Scheduler(model, be, HostConfig(step_tokens=1, vram_budget_bytes=12 * blob, stream_experts="always"))
    try:
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS[:6])    # 1-row steps: uploads
        cached = dict(be.where)
        assert len(cached) == 12 and not streamed
        sched.step_tokens = sched.logit_rows = 4
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS)         # 4-row chunks stream
        assert streamed and be.where == cached                                        # nothing evicted
        n_exp = model.cfg.n_expert
        per_step = len(streamed) / (len(TOKENS) // 4)
        assert per_step == model.cfg.n_layer * n_exp - len(cached)
    finally:
        await sched.aclose()


@pytest.mark.asyncio
async def test_streamed_chunk_fills_free_cache_slots(realistic_gguf):
    """An empty cache: a streamed chunk puts its first lacking experts into the free slots (the same copy), the
    rest into the stream buffer; the next chunk streams only what is still lacking, and the logits stay exact."""
    model = load_model(realistic_gguf)
    blob = ExpertLayout.from_model(model).blob_bytes(0)
    be = StreamVramOnCpu(model, 20)
    to_buffer: list[int] = []
    real = CpuBackend.stream_experts

    def spy(self, layer, items):
        for *_, slot in items:
            if slot is None:                            # through the stream buffer, not into a free cache slot
                to_buffer.append(layer)
        real(self, layer, items)
    sched = Scheduler(model, be, HostConfig(step_tokens=4, vram_budget_bytes=20 * blob, stream_experts="always"))
    try:
        CpuBackend.stream_experts = spy
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS)          # 4 chunks of 4 rows
    finally:
        CpuBackend.stream_experts = real
        await sched.aclose()
    cfg = model.cfg
    total = cfg.n_layer * cfg.n_expert
    assert len(be.where) == len(sched.cache) == 20 and sched.cache.uploads == 20
    assert len(to_buffer) == (total - 20) * 4          # every chunk: all but the 20 cached ones through the buffer


def test_stream_protocol_is_checked(realistic_gguf):
    model = load_model(realistic_gguf)
    be = CpuBackend(model, stream=True)
    cfg = model.cfg
    seq = be.new_seq()
    be.begin(Step((Segment(seq, (3,), 0, "last"),)))
    with pytest.raises(BackendError, match="several rows"):
        be.stream_open(0)
    seq2 = be.new_seq()
    be.begin(Step((Segment(seq2, (3, 17, 42), 0, "last"),)))
    be.stream_open(0)
    with pytest.raises(BackendError, match="not open"):
        be.stream_experts(1, [(0, *_views(be, 0, 0), None)])
    be.stream_experts(0, [(0, *_views(be, 0, 0), None)])
    with pytest.raises(BackendError, match="streamed twice"):
        be.stream_experts(0, [(1, *_views(be, 0, 1), None), (0, *_views(be, 0, 0), None)])
    with pytest.raises(BackendError, match="is open"):
        be.stream_open(2)
    be.stream_close(0)
    with pytest.raises(BackendError, match="post\\[0\\]"):
        be.stream_open(2)                       # layer 0's buffer: its post has not been launched
    be.launch_pre(0)
    route = None
    while route is None:
        route = be.poll_route(0)
    plan = ExpertPlan.of(0, route.ids, cfg.n_embd)
    plan.resident[:] = True
    with pytest.raises(BackendError, match="launch_post_streamed"):
        be.launch_post(plan)                    # a streamed layer posts without a plan
    be.free_seq(seq)
    be.free_seq(seq2)
    be.close()


def test_streamed_post_protocol(realistic_gguf):
    """launch_post_streamed: only for the layer whose pre is out and whose stream is closed, with every expert of the
    layer in a cache slot or the stream; poll_route gives the route after it."""
    model = load_model(realistic_gguf)
    be = CpuBackend(model, stream=True)
    seq = be.new_seq()
    be.begin(Step((Segment(seq, (3, 17, 42), 0, "last"),)))
    be.stream_open(0)
    be.stream_experts(0, [(0, *_views(be, 0, 0), None)])
    be.launch_pre(0)
    with pytest.raises(BackendError, match="no closed stream"):
        be.launch_post_streamed(0)
    be.stream_close(0)
    with pytest.raises(BackendError, match="in no cache slot and were not streamed"):
        be.launch_post_streamed(0)                      # 1 of the layer's experts streamed
    with pytest.raises(BackendError, match="pre\\[0\\] is the one launched"):
        be.launch_post_streamed(1)
    be.free_seq(seq)
    be.close()


@pytest.mark.asyncio
async def test_streamed_layers_need_no_round_trip(realistic_gguf):
    """A streamed layer's post is launched as soon as its copies are enqueued and the next layer's pre right after
    it: the host never reads a streamed layer's route between launches (no doorbell round trip), only waits until
    post[l - STREAM_LAG] has run before pre[l]; the routes come back after the step and the counts are theirs. The
    logits stay exact."""
    from strata.host.scheduler import STREAM_LAG
    model = load_model(realistic_gguf)
    calls: list[tuple[str, int]] = []

    class Order(CpuBackend):
        def launch_pre(self, layer):
            calls.append(("pre", layer))
            super().launch_pre(layer)

        def launch_post_streamed(self, layer):
            calls.append(("post", layer))
            super().launch_post_streamed(layer)

        def post_done(self, layer):
            done = super().post_done(layer)
            if done:
                calls.append(("done", layer))
            return done

        def poll_route(self, layer):
            calls.append(("route", layer))
            return super().poll_route(layer)

        def streamed_routes(self):
            calls.append(("routes", -1))
            got = super().streamed_routes()
            seen.append(got.copy())
            return got
    seen: list[np.ndarray] = []
    sched = Scheduler(model, Order(model, stream=True), HostConfig(step_tokens=8, stream_experts="always"))
    try:
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS[:8])
    finally:
        await sched.aclose()
    n, cfg = model.cfg.n_layer, model.cfg
    assert ("route", 0) not in calls and calls[-1] == ("routes", -1)
    launches = [c for c in calls if c[0] in ("pre", "post")]
    assert launches == [(c, il) for il in range(n) for c in ("pre", "post")]
    for il in range(STREAM_LAG, n):               # pre[l] only once post[l - STREAM_LAG] was seen done
        assert calls.index(("done", il - STREAM_LAG)) < calls.index(("pre", il))
    # the routes the counts used are the reference's: every layer's top-k of its router on the step's rows
    ref = CpuBackend(model, experts="mapped")                  # the device computes every expert itself
    seq = ref.new_seq()
    ref.begin(Step((Segment(seq, tuple(TOKENS[:8]), 0, "last"),)))
    for il in range(n):
        if il in cfg.ple_layers:
            ref.stage_ple(ple_gather(model.weights.per_layer_token_embd,
                                     ple_rows(cfg, TOKENS[:8], NgramWindow.start(cfg))))
        ref.launch_pre(il)
        route = None
        while route is None:
            route = ref.poll_route(il)
        assert np.array_equal(seen[0][il], route.ids), f"layer {il}'s counted routes"
        plan = ExpertPlan.of(il, route.ids, cfg.n_embd)
        plan.resident[:] = True
        ref.launch_post(plan)
    ref.free_seq(seq)
    ref.close()


def _views(be, layer, expert):
    from strata.host.experts import ExpertBlob
    slices = be.layout.layers[layer]
    b = ExpertBlob(layer, expert, slices)
    return b.gate, b.up, b.down


@pytest.mark.asyncio
async def test_stream_choice_follows_the_costs(realistic_gguf):
    """auto: a decode row, or a step whose rows reach few of a layer's experts, never streams; one whose rows give
    every expert 4 routes on average always does; between the two a step tries each mode once per size class
    (streaming first), then takes the one whose steps took less time per row."""
    model = load_model(realistic_gguf)
    cfg = model.cfg
    sched = Scheduler(model, CpuBackend(model, stream=True), HostConfig(stream_experts="auto"))
    try:
        T = lambda reach: int(reach * cfg.n_expert / cfg.n_expert_used)     # rows giving `reach` routes an expert
        assert not sched._streams(SimpleNamespace(T=1)) and not sched._streams(SimpleNamespace(T=T(0.9)))
        assert sched._streams(SimpleNamespace(T=T(4)))            # sure: no trial of the split
        sched._mode_cost[_size_class(T(4))] = {"stream": 1.0, "split": 1e-9}
        assert sched._streams(SimpleNamespace(T=T(4)))
        mid = T(2)
        b = _size_class(mid)
        assert sched._streams(SimpleNamespace(T=mid))             # unmeasured: stream first
        sched._mode_cost[b] = {"stream": 2e-3}
        assert not sched._streams(SimpleNamespace(T=mid))         # then the split's turn
        sched._mode_cost[b]["split"] = 1e-3
        assert not sched._streams(SimpleNamespace(T=mid))         # the split measured faster
        sched._mode_cost[b]["split"] = 3e-3
        assert sched._streams(SimpleNamespace(T=mid))
        sched._mode_cost.clear()
        sched.step_tokens = sched.logit_rows = mid
        await sched.score(TOKENS[:mid])                         # steps of `mid` rows: both modes measured
        assert set(sched._mode_cost[b]) == {"stream"} and sched.chunk_modes["stream"] == 1
        await sched.score(TOKENS[:mid])
        assert set(sched._mode_cost[b]) == {"stream", "split"} and sched.chunk_modes["split"] == 1
        never = Scheduler(model, CpuBackend(model, stream=True), HostConfig(stream_experts="never"))
        assert not never._streams(SimpleNamespace(T=512))
        await never.aclose()
        never = Scheduler(model, CpuBackend(model), HostConfig(stream_experts="always"))   # the engine's CPU
        assert not never._streams(SimpleNamespace(T=512))
        await never.aclose()
        mapped = Scheduler(model, CpuBackend(model, experts="mapped"), HostConfig(stream_experts="always"))
        assert not mapped._streams(SimpleNamespace(T=512))      # every expert resident: nothing to stream
        await mapped.aclose()
    finally:
        await sched.aclose()
    with pytest.raises(ValueError, match="stream_experts"):
        HostConfig(stream_experts="sometimes")


@pytest.mark.asyncio
async def test_stream_buffers_lent_to_the_cache(realistic_gguf):
    """The stream buffers are the cache's between streamed steps (lent_slots): 1-row steps fill them with uploads
    once the cache's own slots are taken; a streamed chunk takes them back first (their experts leave the cache
    and are streamed like any other lacking expert, nothing is loaded into them during the step) and gives them
    back after; the next 1-row steps fill them again. The logits stay exact throughout."""
    model = load_model(realistic_gguf)
    cfg = model.cfg
    blob = ExpertLayout.from_model(model).blob_bytes(0)
    be = StreamVramOnCpu(model, 4)
    lend = be.lent_slots()
    assert lend == 2 * cfg.n_expert and be.expert_slots() == 4 + lend
    taken: list[dict] = []
    real_take = be.take_lent

    def take(stream, rows):
        assert stream
        before = {o: s for o, s in be.where.items() if s >= 4}
        ids = real_take(stream, rows)
        assert ids.tolist() == list(range(4, 4 + lend))
        assert not any(s >= 4 for s in be.where.values())
        taken.append(before)
        return ids
    be.take_lent = take
    sched = Scheduler(model, be, HostConfig(step_tokens=1, vram_budget_bytes=64 * blob, stream_experts="always"))
    ref = Engine.open_sync(realistic_gguf)
    try:
        assert sched.cache.slots == 4 + lend
        await assert_parity(sched, ref, TOKENS[:8])                  # 1-row steps: uploads
        lent_before = {o for o, s in be.where.items() if s >= 4}
        assert lent_before and not taken
        sched.step_tokens = sched.logit_rows = 4
        await assert_parity(sched, ref, TOKENS[:8])                  # 4-row chunks stream
        assert len(taken) == 2 and set(taken[0]) == lent_before
        assert sched.cache._out is None and be._taken is None         # given back after each step
        assert not any(s >= 4 for s in be.where.values())             # nothing went into them meanwhile
        sched.step_tokens = sched.logit_rows = 1
        await assert_parity(sched, ref, TOKENS[:8])                  # 1-row steps fill them again
        assert any(s >= 4 for s in be.where.values())
        assert {o for o, (s, _) in sched.cache._lru.items()} == set(be.where)
    finally:
        await sched.aclose()


@pytest.mark.asyncio
async def test_batch_activations_lent_to_the_cache(realistic_gguf):
    """The batched step's activations' twin (batch_slots), after the stream buffers: the cache's between steps of
    several rows. 1-row steps fill them; a split chunk of 4 rows (stream_experts="never") takes back only the 4 of
    them its rows write (the stream buffers and the other 2 keep their experts), a streamed chunk the stream
    buffers too; nothing goes into what a step took meanwhile; 1-row steps fill them again. The logits stay exact
    throughout."""
    import dataclasses
    model = load_model(realistic_gguf)
    cfg = model.cfg
    blob = ExpertLayout.from_model(model).blob_bytes(0)
    be = StreamVramOnCpu(model, 4, batch_slots=6)
    act0 = 4 + 2 * cfg.n_expert
    assert be.n_lend_act == 6 and be.lent_slots() == 2 * cfg.n_expert + 6 and be.expert_slots() == act0 + 6
    assert be.expert_slots() < cfg.n_layer * cfg.n_expert
    takes: list[tuple] = []
    real_take, real_load = be.take_lent, be.load_expert

    def take(stream, rows):
        stream_held = {o: s for o, s in be.where.items() if 4 <= s < act0}
        act_held = {o: s for o, s in be.where.items() if s >= act0 + rows}
        ids = real_take(stream, rows)
        assert not set(ids.tolist()) & set(be.where.values())
        takes.append((stream, ids.tolist(), stream_held, {o: s for o, s in be.where.items() if 4 <= s < act0},
                      act_held))
        assert act_held.items() <= be.where.items()             # the activations past its rows keep theirs
        return ids

    def load(layer, expert, slot, *parts):
        assert be._taken is None or not be._taken[slot], "an expert loaded into a slot the step took back"
        real_load(layer, expert, slot, *parts)
    be.take_lent, be.load_expert = take, load
    sched = Scheduler(model, be, HostConfig(step_tokens=1, vram_budget_bytes=64 * blob, stream_experts="never"))
    ref = Engine.open_sync(realistic_gguf)
    try:
        await assert_parity(sched, ref, TOKENS[:8])                  # 1-row steps: uploads
        assert any(s >= act0 for s in be.where.values()) and not takes
        sched.step_tokens = sched.logit_rows = 4
        await assert_parity(sched, ref, TOKENS[:8])                  # 4-row chunks, split
        assert [t[:2] for t in takes] == [(False, list(range(act0, act0 + 4)))] * 2     # one a row of the 4
        assert takes[0][2] and takes[0][3] == takes[0][2]            # the stream buffers' experts stay
        assert takes[0][4]                                           # and those past the chunk's rows
        assert sched.cache._out is None and be._taken is None
        sched.step_tokens = sched.logit_rows = 1
        await assert_parity(sched, ref, TOKENS[:8])                  # 1-row steps fill them again
        assert any(s >= act0 for s in be.where.values())
        sched.host = dataclasses.replace(sched.host, stream_experts="always")
        sched.step_tokens = sched.logit_rows = 4
        await assert_parity(sched, ref, TOKENS[:8])                  # 4-row chunks, streamed: both groups
        assert [t[:2] for t in takes[2:]] == [(True, list(range(4, act0 + 4)))] * 2 and not takes[2][3]
        assert {o for o, (s, _) in sched.cache._lru.items()} == set(be.where)
    finally:
        await sched.aclose()
