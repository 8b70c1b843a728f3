"""OpenAI-compatible HTTP server over one Engine: aiohttp, on the engine's (uv)loop.

    GET  /health                   {"status": "ok"}; 503 once the engine has stopped (no API key asked)
    GET  /v1/models, /v1/models/{id}
    POST /v1/chat/completions      the GGUF's chat template; with tools, Qwen tool calls -> OpenAI tool_calls
    POST /v1/completions           a text prompt or token ids
Streaming is server-sent events, `data: {chunk}\\n\\n` in OpenAI's chunk formats, ending with `data: [DONE]`.

Each request is its own engine.generate, so concurrent clients share the engine's steps (continuous batching). A
client that disconnects cancels its handler (aiohttp's handler_cancellation); the handler's generator is closed
with it, and the engine aborts the request and frees its sequence. Errors have OpenAI's shape {"error":
{"message", "type", "param", "code"}}: 400 for a bad request (malformed JSON, a wrong type or value, a request
past the context; OpenAI answers 400 for all of these, never 422), 401 for a missing or wrong API key, 404 for an
unknown model or path, 405, 413; 500 when the engine fails, 503 once it has stopped.

Defaults are OpenAI's: temperature 1, top_p 1, max_tokens 16 for completions; a chat's max_tokens defaults to the
rest of the context.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from strata.chat import ChatFormat, ToolCallStream, parse_tool_calls
from strata.engine import Chunk, Engine, EngineClosed, EngineError
from strata.sampling import SamplingError, SamplingParams, TokenLogprobs

MAX_BODY = 32 << 20         # bytes of a request body: a long conversation with tool schemas fits
SHUTDOWN_S = 2.0            # on shutdown, requests still running after this are cancelled (and aborted)
ROLES = ("system", "developer", "user", "assistant", "tool")
TEMPLATE_ARGS = ("messages", "tools", "documents", "add_generation_prompt")   # what chat_template_kwargs can't set
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
_KINDS = {                  # JSON type checks; bool is not a number here
    "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "a boolean": lambda v: isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "an array": lambda v: isinstance(v, list),
    "an object": lambda v: isinstance(v, dict),
}
log = logging.getLogger("strata.server")


class ApiError(Exception):
    """An error answer in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code

    def response(self) -> web.Response:
        return web.json_response({"error": self.body()}, status=self.status)

    def body(self) -> dict:
        return {"message": str(self), "type": self.type, "param": self.param, "code": self.code}


def _get(body: dict, key: str, kind: str, default=None):
    """body[key] checked against a JSON kind; a missing key or null gives the default."""
    v = body.get(key)
    if v is None:
        return default
    if not _KINDS[kind](v):
        raise ApiError(400, f"'{key}' must be {kind}, got {json.dumps(v)[:80]}", param=key, code="invalid_type")
    return v


def _unsupported(key: str, why: str) -> ApiError:
    return ApiError(400, f"'{key}': {why}", param=key, code="unsupported_parameter")


class Server:
    """The handlers of one engine under one model name."""

    def __init__(self, engine: Engine, name: str, api_key: str | None = None):
        self.engine, self.name, self.api_key = engine, name, api_key
        self.chat = ChatFormat.of(engine)
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=MAX_BODY)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{id}", self.model)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        return app

    # ---- middlewares ---------------------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return e.response()
        except web.HTTPException as e:          # the router's 404 and 405, the body limit's 413
            if e.status < 400:
                raise
            what = f"no such endpoint: {request.method} {request.path}" if e.status == 404 else e.reason
            return ApiError(e.status, what).response()
        except EngineClosed as e:
            return ApiError(503, str(e), type="server_error", code="engine_stopped").response()
        except EngineError as e:
            return ApiError(500, str(e), type="server_error").response()
        except Exception as e:                  # a bug: the client still gets JSON, the log the traceback
            log.exception("%s %s failed", request.method, request.path)
            return ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").response()

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        if self.api_key is not None and request.path.startswith("/v1/"):
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, f"Bearer {self.api_key}".encode()):
                raise ApiError(401, "incorrect or missing API key: send the header 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
        return await handler(request)

    # ---- endpoints -----------------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        closed = self.engine.scheduler.closed
        if closed is not None:
            return web.json_response({"status": "error", "error": str(closed)}, status=503)
        return web.json_response({"status": "ok"})

    def _card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "strata",
                "max_model_len": self.engine.n_ctx}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["id"])
        return web.json_response(self._card())

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        messages = self._messages(body)
        tools = self._tools(body)
        kwargs = _get(body, "chat_template_kwargs", "an object", {})
        bad = [k for k in kwargs if k in TEMPLATE_ARGS]
        if bad:
            raise ApiError(400, f"'chat_template_kwargs' cannot set {bad[0]!r}", param="chat_template_kwargs")
        try:
            ids = self.chat.prompt_ids(messages, tools, **kwargs)
        except ValueError as e:                 # the template refused or failed on these messages
            raise ApiError(400, str(e), param="messages") from None
        top = _get(body, "top_logprobs", "an integer")
        if top is not None and not _get(body, "logprobs", "a boolean", False):
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (top or 0) if _get(body, "logprobs", "a boolean", False) else None
        max_tokens = _get(body, "max_completion_tokens", "an integer", _get(body, "max_tokens", "an integer"))
        params = self._params(body, ids, max_tokens, logprobs, self.chat.end_of_turn, chat=True)
        job = _Job("chat.completion", f"chatcmpl-{uuid.uuid4().hex}", ids, params, tools is not None)
        if _get(body, "stream", "a boolean", False):
            return await self._stream(request, job, self._include_usage(body))
        return web.json_response(await self._complete(job))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                  # a batch of one prompt
        if isinstance(prompt, list) and not all(_KINDS["an integer"](t) for t in prompt):
            raise ApiError(400, "'prompt' must be a string or an array of token ids (one prompt per request)",
                           param="prompt")
        if not isinstance(prompt, (str, list)):
            raise ApiError(400, "'prompt' must be a string or an array of token ids", param="prompt")
        if _get(body, "echo", "a boolean", False):
            raise _unsupported("echo", "not supported")
        if _get(body, "suffix", "a string"):
            raise _unsupported("suffix", "not supported")
        if _get(body, "best_of", "an integer", 1) != 1:
            raise _unsupported("best_of", "only 1 is supported")
        try:
            ids = self.engine.prompt_ids(prompt)
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from None
        params = self._params(body, ids, _get(body, "max_tokens", "an integer", 16),
                              _get(body, "logprobs", "an integer"), (), chat=False)
        job = _Job("text_completion", f"cmpl-{uuid.uuid4().hex}", ids, params, False)
        if _get(body, "stream", "a boolean", False):
            return await self._stream(request, job, self._include_usage(body))
        return web.json_response(await self._complete(job))

    # ---- request parsing -----------------------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as e:                 # UnicodeDecodeError is one
            raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        self._check_model(_get(body, "model", "a string"))
        if _get(body, "n", "an integer", 1) != 1:
            raise _unsupported("n", "only n = 1 is supported")
        if _get(body, "logit_bias", "an object"):
            raise _unsupported("logit_bias", "not supported")
        fmt = _get(body, "response_format", "an object")
        if fmt is not None and fmt.get("type") != "text":
            raise _unsupported("response_format", "only {\"type\": \"text\"} is supported")
        return body

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise ApiError(404, f"the model '{model}' does not exist: this server serves '{self.name}'",
                           param="model", code="model_not_found")

    @staticmethod
    def _messages(body: dict) -> list[dict]:
        """OpenAI messages -> the template's: text parts joined, a null content "", developer -> system."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty array of messages", param="messages")
        out = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise ApiError(400, f"{where} must be an object with 'role' and 'content'", param=where)
            if m.get("role") not in ROLES:
                raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got "
                                    f"{json.dumps(m.get('role'))}", param=f"{where}.role")
            content = m.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise ApiError(400, f"{where}.content: only text parts are supported", param=f"{where}.content")
                content = "".join(p["text"] for p in content)
            elif content is not None and not isinstance(content, str):
                raise ApiError(400, f"{where}.content must be a string or an array of text parts",
                               param=f"{where}.content")
            calls = m.get("tool_calls")
            if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
                raise ApiError(400, f"{where}.tool_calls must be an array of objects", param=f"{where}.tool_calls")
            out.append({**m, "role": "system" if m["role"] == "developer" else m["role"], "content": content or ""})
        return out

    @staticmethod
    def _tools(body: dict) -> list[dict] | None:
        """The tools the prompt offers (None: none, so the reply is not parsed for calls either)."""
        tools = _get(body, "tools", "an array")
        choice = body.get("tool_choice")
        if choice not in (None, "none", "auto"):
            raise _unsupported("tool_choice", "only 'auto' and 'none' are supported (nothing forces a call)")
        for i, t in enumerate(tools or ()):
            if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                    and isinstance(t["function"].get("name"), str)):
                raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                               param=f"tools[{i}]")
        return tools if tools and choice != "none" else None

    def _params(self, body: dict, ids: list[int], max_tokens: int | None, logprobs: int | None,
                stop_ids: tuple[int, ...], *, chat: bool) -> SamplingParams:
        stop = body.get("stop")
        if stop is not None and not isinstance(stop, (str, list)):
            raise ApiError(400, "'stop' must be a string or an array of strings", param="stop", code="invalid_type")
        if max_tokens is None:                  # the rest of the context
            max_tokens = max(self.engine.n_ctx - len(ids), 1)
        try:
            params = SamplingParams(
                temperature=_get(body, "temperature", "a number", 1.0), top_p=_get(body, "top_p", "a number", 1.0),
                top_k=_get(body, "top_k", "an integer", 0), min_p=_get(body, "min_p", "a number", 0.0),
                presence_penalty=_get(body, "presence_penalty", "a number", 0.0),
                frequency_penalty=_get(body, "frequency_penalty", "a number", 0.0),
                repetition_penalty=_get(body, "repetition_penalty", "a number", 1.0),
                seed=_get(body, "seed", "an integer"), max_tokens=max_tokens, logprobs=logprobs,
                stop=stop or (), stop_token_ids=stop_ids)
        except SamplingError as e:             # a chat's logprobs count is its top_logprobs
            raise ApiError(400, str(e), param="top_logprobs" if chat and e.param == "logprobs" else e.param) from None
        try:
            self.engine.check_context(len(ids), params.max_tokens)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages" if chat else "prompt", code="context_length_exceeded") \
                from None
        return params

    @staticmethod
    def _include_usage(body: dict) -> bool:
        return bool(_get(_get(body, "stream_options", "an object", {}), "include_usage", "a boolean", False))

    # ---- answers -------------------------------------------------------------------------------------------------
    def _entry(self, token: int, logprob: float) -> dict:
        b = self.engine.tokenizer.token_bytes(token)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(b)}

    def _chat_logprobs(self, lps: list[tuple[int, TokenLogprobs]]) -> dict:
        return {"content": [{**self._entry(t, lp.logprob), "top_logprobs": [self._entry(i, v) for i, v in lp.top]}
                            for t, lp in lps]}

    def _text_logprobs(self, lps: list[tuple[int, TokenLogprobs]], offset: int = 0) -> dict:
        text = self.engine.tokenizer.token_bytes
        tokens = [text(t).decode("utf-8", errors="replace") for t, _ in lps]
        offsets = [offset + sum(map(len, tokens[:i])) for i in range(len(tokens))]
        tops = []
        for _, lp in lps:                       # keyed by text: of two tokens that read the same, the likelier
            top = {}
            for i, v in lp.top:
                top.setdefault(text(i).decode("utf-8", errors="replace"), v)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for _, lp in lps], "top_logprobs": tops,
                "text_offset": offsets}

    def _usage(self, job: "_Job", last: Chunk) -> dict:
        return {"prompt_tokens": len(job.ids), "completion_tokens": last.index,
                "total_tokens": len(job.ids) + last.index}

    async def _complete(self, job: "_Job") -> dict:
        parts, lps, last = [], [], None
        async with aclosing(self.engine.generate(job.ids, job.params)) as gen:
            async for c in gen:
                parts.append(c.text)
                if c.logprobs is not None:
                    lps.append((c.token, c.logprobs))
                last = c
        text = "".join(parts)
        finish = _FINISH[last.finish_reason]
        want_lp = job.params.logprobs is not None
        if job.object == "text_completion":
            choice = {"index": 0, "text": text, "logprobs": self._text_logprobs(lps) if want_lp else None,
                      "finish_reason": finish}
        else:
            content, calls = parse_tool_calls(text) if job.tools else (text, [])
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls"
            choice = {"index": 0, "message": message, "logprobs": self._chat_logprobs(lps) if want_lp else None,
                      "finish_reason": finish}
        return {"id": job.id, "object": job.object, "created": int(time.time()), "model": self.name,
                "system_fingerprint": None, "choices": [choice], "usage": self._usage(job, last)}

    async def _stream(self, request: web.Request, job: "_Job", include_usage: bool) -> web.StreamResponse:
        chat = job.object == "chat.completion"
        head = {"id": job.id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.name, "system_fingerprint": None}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj: dict) -> None:
            await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

        async def choice(text: str | None, lps=None, finish: str | None = None, calls=None) -> None:
            if chat:
                delta = {} if text is None else {"content": text}
                if calls:
                    delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                c = {"index": 0, "delta": delta, "logprobs": lps and self._chat_logprobs(lps), "finish_reason": finish}
            else:
                c = {"index": 0, "text": text or "", "logprobs": lps and self._text_logprobs(lps, sent),
                     "finish_reason": finish}
            await send({**head, "choices": [c]})

        held = ToolCallStream() if job.tools else None
        sent = 0                                # characters of text sent (completions' text_offset)
        try:
            if chat:
                await send({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
            async with aclosing(self.engine.generate(job.ids, job.params)) as gen:
                async for c in gen:
                    text = held.push(c.text) if held else c.text
                    lps = [(c.token, c.logprobs)] if c.logprobs is not None else None
                    if c.finish_reason is None:
                        if text or lps:
                            await choice(text, lps)
                            sent += len(text)
                        continue
                    rest, calls = held.finish() if held else ("", [])
                    if text + rest:
                        await choice(text + rest)
                    if calls:
                        await choice(None, calls=calls)
                    await choice(None, finish="tool_calls" if calls else _FINISH[c.finish_reason])
                    if include_usage:
                        await send({**head, "choices": [], "usage": self._usage(job, c)})
        except ConnectionResetError:            # the client left: the generator is closed, the request aborted
            return resp
        except EngineError as e:                # the answer has begun: the error goes as an event
            await send({"error": ApiError(503 if isinstance(e, EngineClosed) else 500, str(e),
                                          type="server_error").body()})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@dataclass(frozen=True)
class _Job:
    """One validated generation request."""
    object: str                 # "chat.completion" | "text_completion"
    id: str
    ids: list[int]              # the prompt's token ids
    params: SamplingParams
    tools: bool                 # parse the reply for tool calls


async def serve(engine: Engine, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                name: str | None = None, stop: asyncio.Event | None = None,
                ready: Callable[[str, int], None] | None = None) -> None:
    """Serve until `stop` is set (or the task is cancelled). port 0: any free port; `ready(host, port)` is called
    once the socket listens. name: the model's id in the API (default: the GGUF file's name without .gguf)."""
    name = name or Path(engine.model.file.path).stem
    runner = web.AppRunner(Server(engine, name, api_key).app(), handler_cancellation=True,
                           shutdown_timeout=SHUTDOWN_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        if ready is not None:
            ready(host, runner.addresses[0][1])
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()
