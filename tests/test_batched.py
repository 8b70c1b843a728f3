"""Batched steps equal token-by-token ones: the reference over seeded schedules of several sequences (chunks of 1..9
tokens crossing QSA blocks and the budget, EOS mid-chunk, decode rows beside prompt chunks), the per-stage dump,
and the step loop (continuous batching, isolation of 50 streams, 200 cancellations, one request's own failure)."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from strata.engine import Engine, EngineError, HostConfig
from strata.model.loader import load_model
from strata.reference.model import Batch, RefModel, StageDump, first_divergence
from strata.sampling import SamplingParams

TOL = 1e-6
EOS = 500                       # the tiny preset's


def rel_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row: max |a - b| / max |b|."""
    return np.abs(a - b).max(axis=-1) / np.maximum(np.abs(b).max(axis=-1), 1e-30)


def sequences(rng: np.random.Generator, n: int, length: int) -> list[list[int]]:
    out = []
    for _ in range(n):
        toks = rng.integers(0, 512, length).tolist()
        for i in rng.choice(length, size=3, replace=False):      # EOS mid-sequence, sometimes mid-chunk
            toks[int(i)] = EOS
        out.append(toks)
    return out


@pytest.fixture(scope="module", params=["f32", "realistic"])
def model(request, tmp_path_factory):
    from strata.model.synth import make_model
    path = tmp_path_factory.mktemp(f"batched-{request.param}") / "tiny.gguf"
    make_model("tiny", path, seed=3, mix=request.param, log=lambda s: None)
    return load_model(path)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_schedules_equal_token_by_token(model, seed):
    """Random schedules over 4 sequences (tiny: QSA budget 16 tokens, ratio 4; 60 tokens each, past 3x the
    budget): each step takes a random subset of the sequences, each with a chunk of 1..9 tokens (a chunk of 1 is
    a decode row), in random order. Every row's logits equal that sequence's token-by-token logits within 1e-6,
    and every stage of every layer at every position agrees with the token-by-token dump."""
    rng = np.random.default_rng(seed)
    rm = RefModel(model.weights)
    seqs = sequences(rng, 4, 60)
    want, want_dumps = [], []
    for toks in seqs:
        d = StageDump()
        st = rm.new_state(d)
        want.append(np.stack([rm.step(st, t) for t in toks]))
        want_dumps.append(d)
    dumps = [StageDump() for _ in seqs]
    states = [rm.new_state(d) for d in dumps]
    got = [np.full_like(w, np.nan) for w in want]
    fed = [0] * len(seqs)
    steps = 0
    while any(f < len(s) for f, s in zip(fed, seqs)):
        left = [i for i in range(len(seqs)) if fed[i] < len(seqs[i])]
        pick = [i for i in rng.permutation(left) if rng.random() < 0.7] or [left[0]]
        runs = []
        for i in pick:
            n = int(min(rng.integers(1, 10), len(seqs[i]) - fed[i]))
            runs.append((i, seqs[i][fed[i]:fed[i] + n]))
        b = Batch.of([(states[i], toks) for i, toks in runs])
        out = rm.forward(b, list(range(b.T)))
        at = 0
        for i, toks in runs:
            got[i][fed[i]:fed[i] + len(toks)] = out[at:at + len(toks)]
            at += len(toks)
            fed[i] += len(toks)
        steps += 1
    assert steps < sum(len(s) for s in seqs) // 2          # the schedules did batch
    for i in range(len(seqs)):
        err = rel_rows(got[i], want[i])
        assert err.max() <= TOL, f"sequence {i}: position {err.argmax()} differs by {err.max():.2e}"
        assert first_divergence(dumps[i], want_dumps[i], rtol=TOL) is None, \
            f"sequence {i}: first divergence {first_divergence(dumps[i], want_dumps[i], rtol=TOL)}"
        assert len(dumps[i].data) == len(want_dumps[i].data)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_logits_any_chunking(model, chunk):
    """Engine.logits (teacher-forced, the reference) gives the same logits at any chunk size."""
    toks = sequences(np.random.default_rng(9), 1, 64)[0]
    eng = Engine(model)
    try:
        err = rel_rows(eng.logits(toks, chunk=chunk), eng.logits(toks, chunk=1))
        assert err.max() <= TOL
    finally:
        eng.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("step_tokens", [3, 7, 512])
async def test_step_loop_scores_equal_reference(model, step_tokens):
    """Three scoring requests at once through the step loop, at step budgets that cut every prompt into chunks that
    share steps: every position's logits equal the token-by-token reference's."""
    seqs = sequences(np.random.default_rng(5), 3, 40)
    ref = Engine(model)
    async with Engine(model, host=HostConfig(step_tokens=step_tokens)) as e:
        got = await asyncio.gather(*(e.score(s) for s in seqs))
        for s, g in zip(seqs, got):
            err = rel_rows(g, ref.logits(s, chunk=1))
            assert err.max() <= TOL, f"position {err.argmax()}: {err.max():.2e}"
    ref.close()


def _requests(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(0, 512) for _ in range(rng.randrange(1, 12))]
        params = SamplingParams(max_tokens=rng.randrange(1, 8), temperature=rng.choice([0.0, 0.8, 1.3]),
                                top_k=rng.choice([0, 20]), top_p=rng.choice([1.0, 0.9]), seed=1000 + i,
                                stop_at_eos=rng.random() < 0.5)
        out.append((prompt, params))
    return out


async def _tokens(e: Engine, prompt, params) -> list[int]:
    return [c.token async for c in e.generate(prompt, params) if c.token is not None]


async def _no_state(e: Engine) -> None:
    await e.scheduler.idle()
    assert e.scheduler.live == 0 and e.backend.live == 0
    assert not e.scheduler._active and not e.scheduler._current
    assert e.scheduler.ple is None or e.scheduler.ple.pool._work_queue.qsize() == 0


@pytest.mark.asyncio
async def test_fifty_streams_each_equal_alone(tiny_gguf):
    """50 seeded streams started at staggered moments (so prompt chunks join running decodes): each one's tokens
    equal the same request run alone."""
    reqs = _requests(50, seed=7)
    async with await Engine.open(tiny_gguf, host=HostConfig(step_tokens=24)) as e:
        alone = [await _tokens(e, p, s) for p, s in reqs]
        rng = random.Random(3)

        async def staggered(i):
            for _ in range(rng.randrange(0, 400)):
                await asyncio.sleep(0)
            return await _tokens(e, *reqs[i])

        together = await asyncio.gather(*(staggered(i) for i in range(len(reqs))))
        for i, (a, t) in enumerate(zip(alone, together)):
            assert a == t, f"stream {i}: alone {a}, together {t}"
        await _no_state(e)


@pytest.mark.asyncio
async def test_two_hundred_cancellations_leave_nothing(tiny_gguf):
    """200 requests, 8 at a time beside 2 that run to the end, each of the 8 cancelled after a random number of
    loop turns (queued, mid-prompt, mid-step, between tokens): the 2 in the same steps give what they give alone,
    and no sequence, slot, queued request or read is left."""
    reqs = _requests(200, seed=11)
    keep = _requests(2, seed=12)
    async with await Engine.open(tiny_gguf, host=HostConfig(step_tokens=6)) as e:
        alone = [await _tokens(e, *r) for r in keep]
        rng = random.Random(5)
        for wave in range(0, 200, 8):
            stay = [asyncio.create_task(_tokens(e, *r)) for r in keep]
            tasks = [asyncio.create_task(_tokens(e, *reqs[i])) for i in range(wave, wave + 8)]
            for t in tasks:
                for _ in range(rng.randrange(0, 60)):
                    await asyncio.sleep(0)
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert [await t for t in stay] == alone, f"wave {wave // 8}: a cancellation changed another stream"
        await _no_state(e)


@pytest.mark.asyncio
async def test_bad_token_is_the_requests_error(tiny_gguf):
    """A prompt the model cannot take is refused at submit with the reason; the engine goes on serving."""
    async with await Engine.open(tiny_gguf) as e:
        with pytest.raises(ValueError, match="token id 9999 is not in"):
            e.scheduler.submit([1, 9999], SamplingParams())
        assert await _tokens(e, [1, 2], SamplingParams(max_tokens=2)) and e.scheduler.closed is None


@pytest.mark.asyncio
async def test_own_failure_ends_only_that_request(tiny_gguf, monkeypatch):
    """One request's sampler fails mid-generation: that request ends with an error naming it; the others in the
    same steps produce exactly what they produce without it."""
    from strata import sampling
    reqs = _requests(6, seed=21)
    bad = SamplingParams(max_tokens=6, seed=99, stop_at_eos=False)
    async with await Engine.open(tiny_gguf) as e:
        alone = [await _tokens(e, p, s) for p, s in reqs]
        real = sampling.Sampler.__call__
        calls = {"n": 0}

        def flaky(self, logits):
            if self.p is bad:
                calls["n"] += 1
                if calls["n"] == 3:
                    raise FloatingPointError("sampler failed (injected)")
            return real(self, logits)

        monkeypatch.setattr(sampling.Sampler, "__call__", flaky)
        results = await asyncio.gather(_tokens(e, [1, 2, 3], bad), *(_tokens(e, p, s) for p, s in reqs),
                                       return_exceptions=True)
        assert isinstance(results[0], EngineError) and "sampler failed (injected)" in str(results[0])
        assert list(results[1:]) == alone
        await _no_state(e)


@pytest.mark.asyncio
async def test_default_step_tokens(tiny_gguf):
    """HostConfig.step_tokens=None: 4096 rows for a CUDA backend, with every weight in VRAM or under a budget (its
    chunks run ~2x the rows per second of 512-row ones), 512 on the CPU; a number given is used as it is."""
    from strata.engine import step_tokens
    from strata.host.scheduler import STEP_TOKENS, STEP_TOKENS_VRAM
    assert (STEP_TOKENS, STEP_TOKENS_VRAM) == (512, 4096)
    assert step_tokens(HostConfig()) == 4096
    assert step_tokens(HostConfig(step_tokens=96)) == 96
    with pytest.raises(ValueError, match="at least one token"):
        HostConfig(step_tokens=0)
    async with await Engine.open(tiny_gguf) as e:
        assert e.scheduler.step_tokens == 512


@pytest.mark.asyncio
async def test_prompt_chunks_ramp_up(tiny_gguf, tmp_path, monkeypatch):
    """With PLE rows to read from the file (no table in RAM: ple_cache_bytes=0), a prompt's chunks start at
    RAMP_FIRST rows and double up to step_tokens (only the first chunk's reads are exposed); the tokens equal those
    of even chunks."""
    from strata.host import scheduler as sch
    from strata.host.trace import load
    prompt = list(range(40, 70))                                  # 30 tokens: chunks 2, 4, 8, 8, 8
    params = SamplingParams(max_tokens=6, stop_at_eos=False)
    monkeypatch.setattr(sch, "RAMP_FIRST", 8)
    async with await Engine.open(tiny_gguf, host=HostConfig(step_tokens=8, ple_cache_bytes=0)) as e:
        assert e.scheduler.ple is not None                       # the tiny model reads PLE rows
        even = [c.token async for c in e.generate(prompt, params) if c.token is not None]
    monkeypatch.setattr(sch, "RAMP_FIRST", 2)
    trace = tmp_path / "t.jsonl"
    async with await Engine.open(tiny_gguf, host=HostConfig(step_tokens=8, ple_cache_bytes=0), trace=str(trace)) as e:
        ramped = [c.token async for c in e.generate(prompt, params) if c.token is not None]
    chunks = [row[2] for r in load(str(trace)) for row in r["rows"] if row[1] == "prompt"]
    assert chunks == [2, 4, 8, 8, 8]
    assert ramped == even


def test_default_step_falls_back_when_the_budget_is_short(tiny_gguf, monkeypatch):
    """The CUDA default of 4096-row steps: while those steps' activations do not fit the budget the backend is
    opened again with steps half as long, down to 512; a step size the user gave is not second-guessed."""
    import strata.cuda.backend as cb
    from strata.engine import make_backend
    from strata.host.backend import BudgetTooSmall
    tried, fits = [], 512

    class Fake:
        def __init__(self, model, *, step_tokens, **kw):
            tried.append(step_tokens)
            if step_tokens > fits:
                raise BudgetTooSmall("CudaBackend: the model needs more than the budget leaves")
            self.max_step_tokens = step_tokens
    monkeypatch.setattr(cb, "CudaBackend", Fake)
    model = load_model(tiny_gguf)
    be = make_backend("cuda", model, HostConfig(experts="vram", max_ctx=8192))
    assert tried == [4096, 2048, 1024, 512] and be.max_step_tokens == 512
    tried.clear()
    fits = 2048
    be = make_backend("cuda", model, HostConfig(experts="host", max_ctx=16384))
    assert tried == [4096, 2048] and be.max_step_tokens == 2048
    tried.clear()
    fits = 0
    with pytest.raises(BudgetTooSmall):
        make_backend("cuda", model, HostConfig(experts="host", max_ctx=16384))
    assert tried == [4096, 2048, 1024, 512]
    tried.clear()
    with pytest.raises(BudgetTooSmall):
        make_backend("cuda", model, HostConfig(experts="vram", step_tokens=2048, max_ctx=8192))
    assert tried == [2048]


def test_one_token_rows_equal_the_chunk_hash():
    """A decode step's rows (one token, hashed in Python integers) equal the first row of the vectorized hash over a
    chunk that starts with that token, for random tokens and windows, EOS included, at the tiny and flash shapes."""
    from strata.model.synth import preset_config
    from strata.reference.ple import NgramWindow, ple_rows
    rng = np.random.default_rng(4)
    for preset in ("tiny", "flash"):
        cfg = preset_config(preset)
        for _ in range(300):
            t, a, b = (int(x) for x in rng.integers(0, cfg.n_vocab, 3))
            if rng.random() < 0.2:
                a = cfg.ple_eos
            w = NgramWindow((a, b))
            one = ple_rows(cfg, [t], w)
            assert one.shape == (1, cfg.ple_heads) and one.dtype == np.int64
            assert np.array_equal(one, ple_rows(cfg, [t, 0], w)[:1]), (preset, t, a, b)
