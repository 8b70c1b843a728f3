"""What every front end gets from Engine.generate: stop strings across tokens, the context length, stop token ids,
log-probabilities and penalties against teacher-forced logits, a clear error for a missing CUDA install."""

from __future__ import annotations

import numpy as np
import pytest
import pytest_asyncio

from strata.engine import BackendUnavailable, ContextLengthError, Engine, HostConfig, make_backend
from strata.host.backend import CpuBackend
from strata.model.loader import load_model
from strata.sampling import SamplingParams

PROMPT = "Once upon a time"
N = 40


@pytest_asyncio.fixture
async def eng(tiny_gguf):
    e = await Engine.open(tiny_gguf)
    yield e
    await e.aclose()


async def chunks_of(e: Engine, prompt, params) -> list:
    return [c async for c in e.generate(prompt, params)]


async def greedy(e: Engine, n: int = N) -> list:
    return await chunks_of(e, PROMPT, SamplingParams(max_tokens=n, stop_at_eos=False))


def _boundary_stops(texts: list[str]) -> list[tuple[str, int]]:
    """Stop strings made of the end of one token's text and the start of the next, with the token (index) that
    completes each one's first occurrence in the whole text."""
    out = []
    for i in range(len(texts) - 1):
        a, b = texts[i], texts[i + 1]
        if a and b:
            stop = a[-2:] + b[:2]
            full = "".join(texts)
            end = full.find(stop) + len(stop)
            done = next(k for k in range(len(texts)) if len("".join(texts[:k + 1])) >= end)
            out.append((stop, done))
    return out


@pytest.mark.asyncio
async def test_stop_strings_across_token_boundaries(eng):
    base = await greedy(eng)
    texts = [c.text for c in base[:-1]]
    full = "".join(texts)
    cases = _boundary_stops(texts)
    assert len(cases) >= 10
    for stop, done in cases[::3]:
        got = await chunks_of(eng, PROMPT, SamplingParams(max_tokens=N, stop_at_eos=False, stop=(stop, "\0never")))
        streamed = [c.text for c in got]
        assert "".join(streamed) == full[:full.find(stop)], stop
        assert not any(stop in t for t in streamed)
        assert [c.token for c in got[:-1]] == [c.token for c in base[:done + 1]]    # the same tokens, then stop
        assert got[-1].finish_reason == "stop" and got[-1].index == done + 1 and got[-1].token is None
    # a stop string that starts like the text but never completes holds text back, then gives all of it
    stop = texts[5] + texts[6] + "\0"
    got = await chunks_of(eng, PROMPT, SamplingParams(max_tokens=N, stop_at_eos=False, stop=stop))
    assert "".join(c.text for c in got) == full and got[-1].finish_reason == "length"
    assert got[5].text == "" and got[6].text == ""                                   # held while it could match
    await eng.scheduler.idle()
    assert eng.scheduler.live == 0


@pytest.mark.asyncio
async def test_stop_token_ids_end_like_eos(eng):
    base = await greedy(eng)
    toks = [c.token for c in base[:-1]]
    k = next(i for i in range(3, N) if toks[i] not in toks[:i])                      # its first occurrence
    got = await chunks_of(eng, PROMPT, SamplingParams(max_tokens=N, stop_token_ids=(toks[k],)))
    assert [c.token for c in got[:-1]] == toks[:k] and got[-1].finish_reason == "eos"
    with pytest.raises(ValueError, match="stop_token_ids: 512 is not a token id"):
        await chunks_of(eng, PROMPT, SamplingParams(stop_token_ids=(512,)))


@pytest.mark.asyncio
async def test_context_length_is_enforced(tiny_gguf):
    async with await Engine.open(tiny_gguf) as e:
        assert e.n_ctx == e.cfg.n_ctx_train == 4096                                  # the file's context_length
    async with await Engine.open(tiny_gguf, n_ctx=16) as e:
        ids = e.prompt_ids(PROMPT)
        fits = SamplingParams(max_tokens=16 - len(ids), stop_at_eos=False)
        assert len([c for c in await chunks_of(e, ids, fits) if c.token is not None]) == 16 - len(ids)
        with pytest.raises(ContextLengthError, match=rf"context length is 16 tokens, but the request needs 17 "
                                                     rf"\({len(ids)} in the prompt, max_tokens {17 - len(ids)}\)"):
            await chunks_of(e, ids, SamplingParams(max_tokens=17 - len(ids)))
        await e.scheduler.idle()
        assert e.scheduler.live == 0
    with pytest.raises(ValueError, match="n_ctx = 0"):
        await Engine.open(tiny_gguf, n_ctx=0)


def test_context_length_of_a_bounded_backend(tiny_gguf):
    """A backend that holds a fixed number of positions (CUDA's KV cache) bounds the default and refuses more."""
    model = load_model(tiny_gguf)

    class Holds32(CpuBackend):
        max_ctx = 32

    assert Engine(model, backend=Holds32(model)).n_ctx == 32
    with pytest.raises(ValueError, match="n_ctx = 64 is past the cpu backend's 32 positions"):
        Engine(model, backend=Holds32(model), n_ctx=64)


@pytest.mark.asyncio
async def test_logprobs_match_teacher_forced_logits(eng):
    import torch
    got = await chunks_of(eng, PROMPT, SamplingParams(max_tokens=12, stop_at_eos=False, logprobs=3))
    ids, toks = eng.prompt_ids(PROMPT), [c.token for c in got[:-1]]
    want = torch.log_softmax(torch.tensor(eng.logits(ids + toks[:-1])[len(ids) - 1:]).double(), -1).numpy()
    for c, row in zip(got[:-1], want):
        assert abs(c.logprobs.logprob - row[c.token]) < 1e-9
        top = np.argsort(-row, kind="stable")[:3]
        assert [i for i, _ in c.logprobs.top] == top.tolist() and c.logprobs.top[0][0] == c.token    # greedy
        assert np.allclose([v for _, v in c.logprobs.top], row[top], rtol=0, atol=1e-9)
    assert got[-1].logprobs is None
    assert all(c.logprobs is None for c in await greedy(eng, 3))


@pytest.mark.asyncio
async def test_repetition_penalty_against_transformers(eng):
    """Greedy with a repetition penalty picks, at every step, the argmax of transformers' processor applied to the
    teacher-forced logits of the prompt and the tokens so far."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor
    got = await chunks_of(eng, PROMPT, SamplingParams(max_tokens=16, stop_at_eos=False, repetition_penalty=1.8))
    ids, toks = eng.prompt_ids(PROMPT), [c.token for c in got[:-1]]
    rows = eng.logits(ids + toks[:-1])[len(ids) - 1:]
    proc = RepetitionPenaltyLogitsProcessor(1.8)
    for k, row in enumerate(rows):
        seq = torch.tensor([ids + toks[:k]])
        assert toks[k] == int(proc(seq, torch.tensor(row[None]).double()).argmax())
    assert toks != [c.token for c in (await greedy(eng, 16))[:-1]]                   # the penalty changed them


def test_missing_cuda_install_is_one_clear_error(tiny_gguf):
    from strata.cuda.driver import available
    why = available()
    if why is None or not why.startswith("cuda-bindings"):
        pytest.skip(f"cuda-bindings is installed here ({why or 'a GPU is usable'})")
    with pytest.raises(BackendUnavailable, match=r"cuda-bindings is not installed .* pip install -e '\.\[cuda\]'"):
        make_backend("cuda", load_model(tiny_gguf), HostConfig())


def test_engine_freezes_what_it_loaded(tiny_gguf):
    """Open, the engine moves every object into the collector's permanent generation (full collections then do
    not walk them), and again after the first step of each kind (what the request made for good, lazy imports
    included), so that a full collection after a request walks almost nothing; freeze_gc=False leaves the
    collector as it was."""
    import gc
    params = SamplingParams(max_tokens=3, stop_at_eos=False)
    gc.unfreeze()
    with Engine.open_sync(tiny_gguf, freeze_gc=False) as e:
        e.generate_text("Once upon a time", params)
        assert gc.get_freeze_count() == 0 and e.scheduler.freeze_after == set()
    with Engine.open_sync(tiny_gguf) as e:
        assert gc.get_freeze_count() > 0 and e.scheduler.freeze_after == {"prefill", "decode", "mixed"}
        e.generate_text("Once upon a time", params)
        assert e.scheduler.freeze_after == {"mixed"}          # one prefill step, then decode steps
        gc.collect()
        assert len(gc.get_objects()) < gc.get_freeze_count() / 10
