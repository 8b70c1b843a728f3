"""The OpenAI-compatible server, driven by the official openai client on a local port: answers equal the engine's
own, streaming and not; stop strings; tool calls; concurrent clients; disconnects; bad requests; the API key."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import uvloop

from strata.chat import ChatFormat
from strata.engine import Engine
from strata.host.backend import CpuBackend
from strata.model.loader import load_model
from strata.sampling import SamplingParams
from strata.server import serve

NAME = "tiny"
HI = [{"role": "user", "content": "Hi"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class Tracking(CpuBackend):
    """Counts the most sequences live at once: concurrent requests share the engine."""
    peak = 0

    def new_seq(self, dump=None):
        seq = super().new_seq(dump)
        self.peak = max(self.peak, self.live)
        return seq


class Scripted(CpuBackend):
    """Makes the model say `script` (token ids) from the first generated token on, one request at a time."""
    script: list[int] = []

    def new_seq(self, dump=None):
        self.at = 0
        return super().new_seq(dump)

    def restore(self, snap):                   # a request resumed from a prefix snapshot starts its script too
        self.at = 0
        return super().restore(snap)

    def poll_logits(self):
        out = super().poll_logits()
        if out is not None:
            out = out.copy()
            for row in out:
                row[self.script[min(self.at, len(self.script) - 1)]] = 1e9
                self.at += 1
        return out


class Served:
    """`serve` on a thread of its own (its own uvloop) on a free port of 127.0.0.1, over an engine opened there."""

    def __init__(self, path, backend=Tracking, api_key=None):
        self.path, self.backend_cls, self.api_key = path, backend, api_key
        self.started = threading.Event()
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(60) and self.error is None, self.error

    def _run(self):
        try:
            uvloop.run(self._main())
        except BaseException as e:
            self.error = e
            self.started.set()

    async def _main(self):
        model = await asyncio.to_thread(load_model, self.path)
        self.backend = self.backend_cls(model)
        self.engine = Engine(model, backend=self.backend)
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            await serve(self.engine, port=0, api_key=self.api_key, name=NAME, stop=self.stop, ready=self._ready)
        finally:
            await self.engine.aclose()

    def _ready(self, host, port):
        self.host, self.port = host, port
        self.started.set()

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://{self.host}:{self.port}/v1", max_retries=0,
                             **{"api_key": self.api_key or "none", "timeout": 60, **kw})

    def idle(self, timeout=20.0) -> float:
        """Seconds until the engine had no request left (the server's loop answers)."""
        t = time.monotonic()
        asyncio.run_coroutine_threadsafe(self.engine.scheduler.idle(), self.loop).result(timeout)
        return time.monotonic() - t

    def raw(self, method, path, body: bytes | None = None, headers=None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        out = r.status, r.read()
        conn.close()
        return out

    def close(self):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def served(tiny_gguf):
    s = Served(tiny_gguf)
    yield s
    s.close()


@pytest.fixture(scope="module")
def ref(tiny_gguf):
    """The same model alone, in this thread: what each answer must be."""
    with Engine.open_sync(tiny_gguf) as e:
        yield e


def engine_chat(ref: Engine, messages, **kw) -> tuple[str, str, int, int]:
    """(text, finish_reason, prompt tokens, completion tokens) of the engine alone, as the server must give them."""
    fmt = ChatFormat.of(ref)
    ids = fmt.prompt_ids(messages)
    chunks = list(ref.generate_iter(ids, SamplingParams(stop_token_ids=fmt.end_of_turn, **kw)))
    finish = {"eos": "stop", "stop": "stop", "length": "length"}[chunks[-1].finish_reason]
    return "".join(c.text for c in chunks), finish, len(ids), chunks[-1].index


def engine_text(ref: Engine, prompt, **kw) -> str:
    return ref.generate_text(prompt, SamplingParams(**kw))


def test_health_and_models(served):
    assert served.raw("GET", "/health") == (200, b'{"status": "ok"}')
    models = served.client().models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(NAME, "model", "strata")]
    assert served.client().models.retrieve(NAME).id == NAME


def test_chat_equals_the_engine(served, ref):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    text, finish, n_prompt, n_out = engine_chat(ref, msgs, max_tokens=24)
    c = served.client()
    r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.model == NAME and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == finish and r.choices[0].message.tool_calls is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, n_out,
                                                                                         n_prompt + n_out)
    chunks = list(c.chat.completions.create(model=NAME, messages=msgs, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == finish
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_out
    assert {ch.id for ch in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"


def test_sampling_parameters_reach_the_sampler(served, ref):
    kw = dict(temperature=0.9, top_p=0.95, seed=11, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=20)
    extra = dict(top_k=50, min_p=0.02, repetition_penalty=1.2)
    text, *_ = engine_chat(ref, HI, **kw, **extra)
    r = served.client().chat.completions.create(model=NAME, messages=HI, extra_body=extra, **kw)
    assert r.choices[0].message.content == text
    r = served.client().completions.create(model=NAME, prompt="The keeper", extra_body=extra, **kw)
    assert r.choices[0].text == engine_text(ref, "The keeper", **kw, **extra)


def test_completions_equal_the_engine(served, ref):
    c = served.client()
    want = engine_text(ref, "Once upon a time", max_tokens=16, temperature=0)
    r = c.completions.create(model=NAME, prompt="Once upon a time", temperature=0)      # OpenAI's default: 16
    assert r.object == "text_completion" and r.choices[0].text == want and r.usage.completion_tokens == 16
    ids = ref.prompt_ids("Once upon a time")
    r = c.completions.create(model=NAME, prompt=ids, max_tokens=16, temperature=0, logprobs=2)
    assert r.choices[0].text == want and r.usage.prompt_tokens == len(ids)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 16
    assert all(max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs))      # greedy
    streamed = list(c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=16, temperature=0,
                                         stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "length"


def test_chat_logprobs(served, ref):
    import torch
    r = served.client().chat.completions.create(model=NAME, messages=HI, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=3)
    fmt = ChatFormat.of(ref)
    ids = fmt.prompt_ids(HI)
    toks = [c.token for c in ref.generate_iter(ids, SamplingParams(max_tokens=6, stop_token_ids=fmt.end_of_turn))
            if c.token is not None]
    rows = torch.log_softmax(torch.tensor(ref.logits(ids + toks[:-1])[len(ids) - 1:]).double(), -1)
    content = r.choices[0].logprobs.content
    assert [bytes(e.bytes) for e in content] == [ref.tokenizer.token_bytes(t) for t in toks]
    for e, t, row in zip(content, toks, rows):
        assert abs(e.logprob - float(row[t])) < 1e-9 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob == e.logprob


def test_stop_strings(served, ref):
    msgs = [{"role": "user", "content": "Count for me."}]
    full, *_ = engine_chat(ref, msgs, max_tokens=30)
    pieces = [c.text for c in ref.generate_iter(ChatFormat.of(ref).prompt_ids(msgs), SamplingParams(
        max_tokens=30, stop_token_ids=ChatFormat.of(ref).end_of_turn)) if c.token is not None]
    i = next(i for i in range(8, 29) if pieces[i] and pieces[i + 1])
    stop = pieces[i][-1] + pieces[i + 1][:1]                     # spans two tokens
    want = full[:full.find(stop)]
    c = served.client()
    r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=30, temperature=0, stop=[stop, "\0"])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    deltas = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=30, temperature=0, stop=stop, stream=True) if ch.choices]
    assert "".join(deltas) == want and not any(stop in d for d in deltas)


@pytest.fixture(scope="module")
def scripted(tiny_gguf):
    s = Served(tiny_gguf, backend=Scripted)
    yield s
    s.close()


def say(s: Served, ref: Engine, text: str) -> None:
    """The scripted model's next replies: `text`, then the end of its turn."""
    s.backend.script = ref.tokenizer.encode(text) + [ref.tokenizer.encode("<|im_end|>")[0]]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _stream_calls(chunks) -> tuple[str, list, str]:
    content, calls, finish = "", {}, None
    for ch in chunks:
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or ():
            calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def test_tool_calls(scripted, ref):
    c = scripted.client()
    ask = dict(model=NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
               temperature=0, max_tokens=200)
    say(scripted, ref, CALL)
    r = c.chat.completions.create(**ask)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content is None
    assert [(t.type, t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [
        ("function", "get_weather", {"city": "Paris"})]
    content, calls, finish = _stream_calls(c.chat.completions.create(**ask, stream=True))
    assert content == "" and finish == "tool_calls"
    assert [(t["name"], json.loads(t["arguments"])) for t in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("call_")

    say(scripted, ref, "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Lyon"))
    content, calls, finish = _stream_calls(c.chat.completions.create(**ask, stream=True))
    assert content.strip() == "Let me check." and [json.loads(t["arguments"])["city"] for t in calls] == [
        "Paris", "Lyon"] and finish == "tool_calls"
    # the call goes back into the conversation as the template expects it
    follow = [*ask["messages"], r.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "sunny"}]
    say(scripted, ref, "It is sunny.")
    r2 = c.chat.completions.create(**{**ask, "messages": follow})
    assert r2.choices[0].message.content == "It is sunny." and r2.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("text,max_tokens,finish", [
    (CALL, 12, "length"),                                        # truncated by max_tokens
    (CALL.replace('"arguments"', "arguments"), 200, "stop"),     # not JSON
    ('<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>', 200, "stop"),
])
def test_broken_tool_calls_are_text(scripted, ref, text, max_tokens, finish):
    c = scripted.client()
    ask = dict(model=NAME, messages=HI, tools=[WEATHER_TOOL], temperature=0, max_tokens=max_tokens)
    say(scripted, ref, text)
    want = ref.tokenizer.decode(ref.tokenizer.encode(text)[:max_tokens])
    r = c.chat.completions.create(**ask)
    assert r.choices[0].message.content == want and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == finish
    assert _stream_calls(c.chat.completions.create(**ask, stream=True)) == (want, [], finish)


def test_without_tools_a_call_is_text(scripted, ref):
    say(scripted, ref, CALL)
    r = scripted.client().chat.completions.create(model=NAME, messages=HI, temperature=0)
    assert r.choices[0].message.content == CALL and r.choices[0].finish_reason == "stop"
    r = scripted.client().chat.completions.create(model=NAME, messages=HI, temperature=0, tools=[WEATHER_TOOL],
                                                  tool_choice="none")
    assert r.choices[0].message.content == CALL


def test_concurrent_clients_no_cross_talk(served, ref):
    jobs = [("chat", [{"role": "user", "content": "Hello there"}], dict(temperature=0, max_tokens=30), False),
            ("chat", [{"role": "user", "content": "Tell me more"}], dict(temperature=0.8, seed=3, max_tokens=28), True),
            ("text", "The keeper walked", dict(temperature=1.1, top_p=0.9, seed=5, max_tokens=26), False),
            ("text", "In his notebook", dict(temperature=0, max_tokens=32), True),
            ("chat", [{"role": "user", "content": "Why?"}], dict(temperature=0.7, seed=9, max_tokens=25), True),
            ("text", [5, 6, 7, 8, 9], dict(temperature=0.5, seed=1, max_tokens=30), False)]
    want = [engine_chat(ref, p, **kw)[0] if kind == "chat" else engine_text(ref, p, **kw)
            for kind, p, kw, _ in jobs]

    def run(job) -> str:
        kind, p, kw, stream = job
        c = served.client()
        if kind == "chat":
            r = c.chat.completions.create(model=NAME, messages=p, stream=stream, **kw)
            return "".join(ch.choices[0].delta.content or "" for ch in r) if stream else r.choices[0].message.content
        r = c.completions.create(model=NAME, prompt=p, stream=stream, **kw)
        return "".join(ch.choices[0].text for ch in r) if stream else r.choices[0].text

    served.backend.peak = 0
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    assert got == want
    assert served.backend.peak >= 2                              # they ran together, in shared steps
    served.idle()
    assert served.engine.scheduler.live == 0


def test_client_disconnect_frees_the_request(served):
    """A client that leaves mid-stream, or mid-request, has its request aborted at once: 3000 tokens would take a
    minute here; the engine is idle within seconds."""
    c = served.client()
    stream = c.chat.completions.create(model=NAME, messages=HI, max_tokens=3000, temperature=0, stream=True)
    for _, _ in zip(range(3), stream):
        pass
    assert served.engine.scheduler.live == 1
    stream.close()
    assert served.idle() < 10
    assert served.engine.scheduler.live == 0 and served.backend.live == 0
    with pytest.raises(openai.APITimeoutError):
        served.client(timeout=1.0).completions.create(model=NAME, prompt="Hi", max_tokens=3000, temperature=0)
    assert served.idle() < 10
    assert served.engine.scheduler.live == 0 and served.backend.live == 0
    assert served.client().completions.create(model=NAME, prompt="Hi", max_tokens=3, temperature=0).usage \
        .completion_tokens == 3


def _error(status_body) -> tuple[int, dict]:
    status, body = status_body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return status, err


def test_bad_requests_are_openai_errors(served):
    c = served.client()
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-5", messages=HI)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    for kw, param in [(dict(max_tokens=-1), "max_tokens"), (dict(temperature=-0.5), "temperature"),
                      (dict(top_p=0), "top_p"), (dict(n=2), "n"), (dict(top_logprobs=3), "top_logprobs"),
                      (dict(logprobs=True, top_logprobs=50), "top_logprobs"), (dict(stop=[""]), "stop"),
                      (dict(seed=-1), "seed"), (dict(max_tokens=5000), "messages"),
                      (dict(extra_body={"min_p": 2}), "min_p"), (dict(tool_choice="required"), "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=NAME, messages=HI, **kw)
        assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error", kw
    assert e.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=HI, max_tokens=5000)
    assert e.value.body["code"] == "context_length_exceeded" and "context length is 4096" in e.value.body["message"]
    for body, param in [({"messages": HI, "temperature": "hot"}, "temperature"),
                        ({"messages": HI, "max_tokens": 2.5}, "max_tokens"), ({"messages": HI, "stream": "yes"},
                                                                               "stream"),
                        ({"messages": "Hi"}, "messages"), ({}, "messages"),
                        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
                        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
                        ({"messages": HI, "tools": [{"type": "function"}]}, "tools[0]")]:
        status, err = _error(served.raw("POST", "/v1/chat/completions", json.dumps(body).encode()))
        assert (status, err["param"]) == (400, param), body
    for path, body, param in [("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
                              ("/v1/completions", {"prompt": [99999]}, "prompt"),
                              ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
                              ("/v1/completions", {"prompt": ""}, "prompt")]:
        status, err = _error(served.raw("POST", path, json.dumps(body).encode()))
        assert (status, err["param"]) == (400, param), body
    assert _error(served.raw("POST", "/v1/chat/completions", b'{"messages": [')) [0] == 400
    assert _error(served.raw("POST", "/v1/chat/completions", b'\xff\xfe'))[1]["code"] == "invalid_json"
    assert _error(served.raw("POST", "/v1/chat/completions", b'[1, 2]'))[0] == 400
    assert _error(served.raw("GET", "/v1/chat/completions"))[0] == 405
    assert _error(served.raw("GET", "/v1/nothing"))[0] == 404
    assert _error(served.raw("GET", "/v1/models/other"))[1]["code"] == "model_not_found"
    # and the server still serves
    assert c.chat.completions.create(model=NAME, messages=HI, max_tokens=2, temperature=0).usage \
        .completion_tokens == 2
    served.idle()
    assert served.engine.scheduler.live == 0


def test_server_sent_events_on_the_wire(served):
    status, body = served.raw("POST", "/v1/completions", json.dumps(
        {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True}).encode())
    events = body.decode().split("\n\n")
    assert status == 200 and events[-2:] == ["data: [DONE]", ""]
    parsed = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2]) and 2 <= len(parsed) <= 4     # empty deltas skipped
    assert [p["choices"][0]["finish_reason"] for p in parsed] == [None] * (len(parsed) - 1) + ["length"]
    assert {p["object"] for p in parsed} == {"text_completion"}


def test_api_key(tiny_gguf):
    s = Served(tiny_gguf, api_key="sekrit")
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            s.client(api_key="wrong").models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        assert _error(s.raw("POST", "/v1/completions", b"{}"))[0] == 401
        assert s.raw("GET", "/health")[0] == 200                # health asks no key
        r = s.client().completions.create(model=NAME, prompt="Hi", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
    finally:
        s.close()
