"""The async API over the CPU backend: streams, concurrency, cancellation, failures, the sync wrappers."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import pytest_asyncio

from strata.engine import Engine, EngineClosed, EngineError, HostConfig, PollPolicy
from strata.host.backend import BackendError, CpuBackend
from strata.host.scheduler import DoorbellTimeout
from strata.model.loader import load_model
from strata.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, stop_at_eos=False)
PROMPTS = [("Once upon a time", GREEDY),
           ("The keeper", SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=7, stop_at_eos=False)),
           ([3, 500, 9, 9, 41], SamplingParams(temperature=1.2, top_p=0.8, seed=3, max_tokens=5, stop_at_eos=False))]


@pytest_asyncio.fixture
async def eng(tiny_gguf):
    e = await Engine.open(tiny_gguf)
    yield e
    await e.aclose()


async def tokens_of(e: Engine, prompt, params) -> list[int]:
    return [c.token async for c in e.generate(prompt, params) if c.token is not None]


async def assert_no_state(e: Engine) -> None:
    await e.scheduler.idle()
    assert e.scheduler.live == 0 and e.backend.live == 0


@pytest.mark.asyncio
async def test_stream_chunks(eng):
    seen = []
    chunks = [c async for c in eng.generate("Once upon a time", GREEDY, progress=lambda d, t: seen.append((d, t)))]
    ids = eng.prompt_ids("Once upon a time")
    toks = [c.token for c in chunks[:-1]]
    assert seen == [(len(ids), len(ids))]                 # the prompt is one chunk: one progress event
    assert [c.index for c in chunks] == list(range(7)) and len(toks) == 6
    assert all(c.prompt_tokens == len(ids) and c.finish_reason is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.token is None and last.finish_reason == "length" and last.index == 6
    assert "".join(c.text for c in chunks) == eng.tokenizer.decode(toks)
    assert last.timings.prefill_tok_s > 0 and last.timings.decode_tok_s > 0
    assert {"doorbell", "post_launch", "cpu_wait", "other"} <= set(last.timings.stage_ms)
    # greedy decoding picks the teacher-forced argmax at every step
    ref = eng.logits(ids + toks[:-1])
    assert toks == [int(np.argmax(ref[len(ids) - 1 + i])) for i in range(6)]


class OneAtATime(CpuBackend):
    """Like the CUDA backend: one live sequence; a second new_seq is a failure."""
    max_seqs = 1

    def new_seq(self, dump=None):
        if self.live:
            raise BackendError("new_seq: a sequence is already live")
        return super().new_seq(dump)


@pytest.mark.asyncio
@pytest.mark.parametrize("one_at_a_time", [False, True])
async def test_concurrent_streams_match_each_alone(one_at_a_time, tiny_gguf):
    model = load_model(tiny_gguf)
    async with Engine(model, backend=OneAtATime(model) if one_at_a_time else CpuBackend(model)) as e:
        alone = [await tokens_of(e, p, s) for p, s in PROMPTS]
        together = await asyncio.gather(*(tokens_of(e, p, s) for p, s in PROMPTS))
        assert list(together) == alone
        await assert_no_state(e)


@pytest.mark.asyncio
async def test_cancel_at_random_points(eng):
    """Cancel a consumer after a random number of events (prompt progress or chunks) plus a random number of loop
    turns: in the prompt, mid-layer, between tokens. Nothing leaks and the next request is served correctly."""
    expected = [await tokens_of(eng, p, s) for p, s in PROMPTS]
    rng = random.Random(1234)
    for trial in range(10):
        p, s = PROMPTS[trial % 3]
        bystander = asyncio.create_task(tokens_of(eng, *PROMPTS[(trial + 1) % 3]))
        events = []

        async def consume() -> None:
            async for c in eng.generate(p, s, progress=lambda done, total: events.append(done)):
                events.append(c)

        task = asyncio.create_task(consume())
        k = rng.randrange(0, len(eng.prompt_ids(p)) + s.max_tokens)
        while len(events) < k and not task.done():
            await asyncio.sleep(0)
        for _ in range(rng.randrange(0, 200)):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await bystander == expected[(trial + 1) % 3], f"trial {trial}: a cancel disturbed another stream"
        await assert_no_state(eng)
        assert await tokens_of(eng, p, s) == expected[trial % 3]
    await assert_no_state(eng)


@pytest.mark.asyncio
async def test_breaking_out_aborts(eng):
    async for c in eng.generate("Once upon a time", SamplingParams(max_tokens=50)):
        break
    await assert_no_state(eng)


@pytest.mark.asyncio
async def test_finish_reasons(tiny_gguf):
    model = load_model(tiny_gguf)
    eos = 500

    class EosAtThird(CpuBackend):
        """Forces EOS as the third generated token of every request (one request at a time)."""
        def new_seq(self, dump=None):
            self.heads = 0
            return super().new_seq(dump)

        def poll_logits(self):
            out = super().poll_logits()
            if out is not None:
                self.heads += 1
                if self.heads == 3:                         # the prompt's step, then generated tokens 1, 2
                    out = out.copy()
                    out[:, eos] = 1e9
            return out

    async with Engine(model, backend=EosAtThird(model)) as e:
        prompt = [1, 2, 3, 4]
        chunks = [c async for c in e.generate(prompt, SamplingParams(max_tokens=10))]
        assert [c.finish_reason for c in chunks] == [None, None, "eos"] and eos not in [c.token for c in chunks]
        chunks = [c async for c in e.generate(prompt, SamplingParams(max_tokens=10, stop_at_eos=False))]
        assert chunks[2].token == eos and chunks[-1].finish_reason == "length" and chunks[-1].index == 10
        chunks = [c async for c in e.generate(prompt, SamplingParams(max_tokens=0))]
        assert len(chunks) == 1 and chunks[0].finish_reason == "length" and chunks[0].index == 0
        await assert_no_state(e)


@pytest.mark.asyncio
@pytest.mark.parametrize("module", ["ple_io", "experts"])
async def test_read_error_reaches_every_stream_and_engine_recovers(module, tiny_gguf, monkeypatch):
    """A failing pread of a PLE row or an expert blob: every open stream raises, then the engine works again."""
    import importlib
    # experts and PLE rows are read on every use
    e = await Engine.open(tiny_gguf, host=HostConfig(host_budget_bytes=0, ple_cache_bytes=0))
    try:
        expected = await tokens_of(e, *PROMPTS[0])
        mod = importlib.import_module(f"strata.host.{module}")
        real = mod.pread_into

        def fail_once(*args):
            monkeypatch.setattr(mod, "pread_into", real)
            raise OSError(5, "Input/output error (injected)")

        monkeypatch.setattr(mod, "pread_into", fail_once)
        results = await asyncio.gather(*(tokens_of(e, p, s) for p, s in PROMPTS), return_exceptions=True)
        assert all(isinstance(r, EngineError) and isinstance(r.__cause__, OSError) for r in results), results
        assert sum("Input/output error (injected)" in str(r) for r in results) == 3
        await assert_no_state(e)
        assert await tokens_of(e, *PROMPTS[0]) == expected      # the engine stays usable
    finally:
        await e.aclose()


@pytest.mark.asyncio
async def test_backend_failure_reaches_every_stream(tiny_gguf):
    model = load_model(tiny_gguf)

    class DiesAtPost20(CpuBackend):
        posts = 0

        def launch_post(self, plan):
            self.posts += 1
            if self.posts == 20:
                raise BackendError("device lost (injected)")
            super().launch_post(plan)

    e = Engine(model, backend=DiesAtPost20(model))
    results = await asyncio.gather(*(tokens_of(e, p, s) for p, s in PROMPTS), return_exceptions=True)
    assert all(isinstance(r, EngineError) and isinstance(r.__cause__, BackendError) for r in results), results
    assert e.scheduler.live == 0 and e.backend.live == 0
    with pytest.raises(EngineClosed, match="device lost"):
        await tokens_of(e, *PROMPTS[0])
    await e.aclose()


@pytest.mark.asyncio
async def test_doorbell_timeout_is_an_error(tiny_gguf):
    model = load_model(tiny_gguf)

    class NeverRings(CpuBackend):
        def poll_route(self, layer):
            return None if layer == 1 else super().poll_route(layer)

    e = Engine(model, backend=NeverRings(model), host=HostConfig(poll=PollPolicy(spin_s=1e-3, timeout_s=0.2)))
    with pytest.raises(EngineError, match=r"pre\[1\].*did not complete") as err:
        await tokens_of(e, *PROMPTS[0])
    assert isinstance(err.value.__cause__, DoorbellTimeout)
    assert e.scheduler.closed is not None
    await e.aclose()


@pytest.mark.asyncio
async def test_score_matches_logits(eng):
    toks = [3, 17, 500, 42, 99, 500]
    assert np.array_equal(await eng.score(toks), eng.logits(toks))


def test_sync_wrappers(tiny_gguf):
    with Engine.open_sync(tiny_gguf) as e:
        chunks = list(e.generate_iter(*PROMPTS[1]))
        text = e.generate_text(*PROMPTS[1])
        assert text == "".join(c.text for c in chunks) and chunks[-1].finish_reason == "length"
        assert e.generate_text("Once upon a time", GREEDY) == e.generate_text("Once upon a time", GREEDY)
        it = e.generate_iter("Once upon a time", SamplingParams(max_tokens=40))
        next(it)
        it.close()                                           # abandoning the iterator aborts the request
        e._loop.run_until_complete(e.scheduler.idle())      # (freed when the driver next runs)
        assert e.scheduler.live == 0

        async def inside_a_loop():
            with pytest.raises(RuntimeError, match="async for"):
                e.generate_text("x")
        asyncio.run(inside_a_loop())


def test_expert_placement_choice(tiny_gguf, monkeypatch):
    """HostConfig.experts: a bad value is a clear error before any device is touched; 'auto' picks 'vram' only when
    the budget holds every weight but the PLE table, with 2 GiB to spare."""
    import sys
    import types

    from strata.engine import make_backend
    model = load_model(tiny_gguf)
    picked = []

    class Probe:                       # stands in for CudaBackend (no GPU, maybe no cuda-bindings here)
        def __init__(self, model, **kw):
            picked.append(kw["experts"])
    monkeypatch.setitem(sys.modules, "strata.cuda.backend", types.SimpleNamespace(CudaBackend=Probe))
    with pytest.raises(ValueError, match="HostConfig.experts='everywhere'"):
        make_backend("cuda", model, HostConfig(experts="everywhere"))
    need = sum(t.nbytes for n, t in model.file.tensors.items() if n != "per_layer_token_embd.weight")
    for budget in (None, need + (2 << 30) - 1, need + (2 << 30)):
        make_backend("cuda", model, HostConfig(vram_budget_bytes=budget))
    assert picked == ["host", "host", "vram"]


def test_cpu_expert_placement_choice(tiny_gguf):
    """On the cpu backend 'auto' computes the experts from the mapping (they fit half the RAM) unless a host budget
    smaller than them asks for the store; 'vram' (every expert on the device) is the mapping too."""
    from strata.engine import make_backend
    model = load_model(tiny_gguf)
    need = sum(t.nbytes for n, t in model.file.tensors.items() if "_exps." in n)
    cases = [(HostConfig(), "mapped"), (HostConfig(host_budget_bytes=need), "mapped"),
             (HostConfig(host_budget_bytes=need - 1), "host"), (HostConfig(experts="host"), "host"),
             (HostConfig(experts="vram"), "mapped")]
    for host, want in cases:
        be = make_backend("cpu", model, host)
        assert be.experts == want, host
        be.close()
    with pytest.raises(ValueError, match="HostConfig.experts='everywhere'"):
        make_backend("cpu", model, HostConfig(experts="everywhere"))


@pytest.mark.asyncio
async def test_preload_experts_fills_the_store(tiny_gguf):
    e = await Engine.open(tiny_gguf)
    try:
        s, cfg = e.scheduler, e.cfg
        n = await e.preload_experts()
        assert n == sum(s.layout.blob_bytes(il) for il in range(cfg.n_layer)) * cfg.n_expert
        assert len(s.store) == cfg.n_layer * cfg.n_expert and s.store.reads == len(s.store)
    finally:
        await e.aclose()
