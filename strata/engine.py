"""Engine: open a model file and run it. Teacher-forced reference logits, and generation through the token loop.

    engine = await Engine.open(path, backend="cpu")                 # or Engine.open_sync(path, ...) in a script
    async for chunk in engine.generate("Once upon a time", SamplingParams(max_tokens=32)):
        print(chunk.text, end="")                                   # chunk.finish_reason on the last one
    text = engine.generate_text("Once upon a time")                 # sync wrapper (not inside a running loop)

The async layer is a thin shell over strata.host.scheduler: generate() is one request's collector; cancelling or
closing it aborts the request and frees its state. An engine failure reaches every open stream as EngineError.
Every front end gets the same checks here: the context length (prompt + max_tokens <= n_ctx, else
ContextLengthError), stop strings (held back across tokens, never emitted) and extra stop token ids.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from strata.host.backend import Backend, BudgetTooSmall, CpuBackend
from strata.host.direct_io import ram_bytes
from strata.host.scheduler import (STEP_TOKENS, STEP_TOKENS_VRAM, EngineClosed, EngineError, Finished, HostConfig,
                                   PollPolicy, Progress, Scheduler, Timings, TokenOut)
from strata.host.trace import Tracer
from strata.model.loader import Model, load_model
from strata.reference.model import RefModel, StageDump
from strata.sampling import SamplingParams, TokenLogprobs
from strata.stops import StopStrings
from strata.tokenizer import Tokenizer

LOGITS_CHUNK = 256        # tokens per reference step in Engine.logits: the batch amortizes each matrix's dispatch
DEFAULT_CTX = 8192        # the context length of a file that does not give its context_length

__all__ = ["BackendUnavailable", "Chunk", "ContextLengthError", "Engine", "EngineClosed", "EngineError", "HostConfig",
           "PollPolicy", "Timings"]


class ContextLengthError(ValueError):
    """A request that does not fit the context: prompt tokens + max_tokens > the engine's n_ctx."""


class BackendUnavailable(RuntimeError):
    """The backend cannot start on this machine (its package or its device is missing); the message says why and
    what fixes it."""


@dataclass(frozen=True)
class Chunk:
    """One step of a generation stream: a token's text delta, or (the last chunk) the finish."""
    text: str                      # text delta; never splits a UTF-8 character
    token: int | None              # the generated token id; None on the final chunk
    index: int                     # this token's index among the generated; the final chunk: how many there were
    prompt_tokens: int
    finish_reason: str | None      # None, then "eos", "stop" (a stop string) or "length" on the final chunk
    timings: Timings               # prefill tok/s, decode tok/s, mean ms per token by stage
    logprobs: TokenLogprobs | None = None     # the token's, when SamplingParams.logprobs asks


def step_tokens(host: HostConfig) -> int:
    """The CUDA backend's largest step: HostConfig.step_tokens, or by default 4096 rows (STEP_TOKENS_VRAM) with
    every weight in VRAM and under a budget alike. Under a budget each chunk streams every layer's experts once
    whatever its rows (4096-row chunks measured 2.3x the prefill of 512-row ones at 4K, bench/RESULTS.md
    2026-12-02), and the step's activations (5.8 GB for flash) are expert cache slots between batched steps
    (CudaBackend.lent_slots); 8192-row steps prefill long prompts faster and cost short ones and the decode after
    a long one (scheduler.py STEP_TOKENS_VRAM). Where the budget cannot hold the activations beside the weights,
    make_backend halves the steps down to 512 (STEP_TOKENS)."""
    if host.step_tokens is not None:
        return host.step_tokens
    return STEP_TOKENS_VRAM


def make_backend(backend: str | Backend, model: Model, host: HostConfig) -> Backend:
    if not isinstance(backend, str):
        return backend
    if backend == "cpu":
        experts = host.experts
        if experts == "auto":          # the mapping holds every expert: mapped, unless a host budget asks for less
            need = sum(t.nbytes for n, t in model.file.tensors.items() if "_exps." in n)
            room = ram_bytes() // 2
            fits = need <= room and (host.host_budget_bytes is None or need <= host.host_budget_bytes)
            experts = "mapped" if fits else "host"
        if experts not in ("mapped", "vram", "host"):
            raise ValueError(f"HostConfig.experts={experts!r}: choose 'auto', 'mapped' (or 'vram') or 'host'")
        # "vram" (every expert resident on the device) is, on the CPU, the mapped file
        return CpuBackend(model, experts="host" if experts == "host" else "mapped")
    if backend == "cuda":
        from strata.cuda.backend import CudaBackend  # lazily: cuda-bindings only where there is a GPU
        from strata.cuda.driver import CudaError, available
        experts = host.experts
        if experts == "auto":          # everything but the PLE table (it stays on disk) fits the budget, with 2 GiB
            need = sum(t.nbytes for n, t in model.file.tensors.items() if n != "per_layer_token_embd.weight")
            budget = host.vram_budget_bytes
            experts = "vram" if budget is not None and budget >= need + (2 << 30) else "host"
        if experts not in ("vram", "host"):
            raise ValueError(f"HostConfig.experts={experts!r}: choose 'auto', 'vram' or 'host'")
        # experts="host": experts stay in host memory; the VRAM left after the dense weights is the expert cache
        def log(line: str) -> None:
            print(line, file=sys.stderr)

        def open_cuda(rows: int):
            return CudaBackend(model, vram_budget_bytes=host.vram_budget_bytes, experts=experts,
                               max_ctx=host.max_ctx, doorbell_timeout_s=host.poll.timeout_s,
                               budget_counts_device=True, step_tokens=min(rows, host.max_ctx),
                               mapped_reads=host.mapped_reads, prefetch_extra=host.prefetch_extra, log=log)
        rows = step_tokens(host)
        try:
            while True:
                try:
                    return open_cuda(rows)
                except BudgetTooSmall:
                    if host.step_tokens is not None or rows <= STEP_TOKENS:
                        raise
                    # the default's larger steps take activations the budget may not hold beside every weight
                    smaller = max(STEP_TOKENS, rows // 2)
                    log(f"strata.cuda: steps of {rows} rows do not fit the budget; trying steps of {smaller}")
                    rows = smaller
        except CudaError as e:
            why = available()       # None: CUDA works and the failure is the backend's own
            if why is None:
                raise
            fix = " Install it with: pip install -e '.[cuda]'" if why.startswith("cuda-bindings") else ""
            raise BackendUnavailable(f"the cuda backend cannot start: {why}.{fix}") from e
    raise ValueError(f"unknown backend '{backend}': choose 'cpu' or 'cuda'")


def _resolve(path: str | os.PathLike | None) -> str | os.PathLike:
    if path is None:
        from strata.default_model import default_model_path
        return default_model_path()
    return path


class Engine:
    """One loaded model: weights mapped from the GGUF, its tokenizer, the reference stages over them (logits), and
    the token loop over a backend (generate). The backend and scheduler live on the event loop that first uses them."""

    def __init__(self, model: Model, exact: bool = False, *, backend: str | Backend = "cpu",
                 host: HostConfig = HostConfig(), trace: str | os.PathLike | None = None, n_ctx: int | None = None,
                 log: Callable[[str], None] | None = None, freeze_gc: bool = True):
        """n_ctx: the context length every request must fit (prompt + max_tokens); None: the file's context_length
        (DEFAULT_CTX when it has none), at most what the backend holds (a device KV cache's max_ctx). `log` gets
        the open line (open_line: the memory tiers, how the file is read, peak RSS). freeze_gc: once open, move
        every object the process holds into the collector's permanent generation (gc.freeze), so that Python's
        full collections, which stop every thread, no longer walk the imported modules and the model's objects
        (on the H200's host, waits of 88 and 112 ms held back a streamed prefill chunk's launches and were gone
        with the collector off: 1,932 ms a chunk, 1,729 off; bench/RESULTS.md 2026-12-03); again after the first step
        of each kind, for what it made to last (lazy imports, compiled kernels, graphs). Frozen objects are still
        freed when their last reference goes (the engine's own are: it holds no cycles), but never as cyclic
        garbage, so the open collects first."""
        self.model = model
        self.cfg = model.cfg
        self.tokenizer = Tokenizer.from_metadata(model.metadata)
        self.ref = RefModel(model.weights)
        self.exact = exact
        if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 1):
            raise ValueError(f"n_ctx = {n_ctx!r}: the context length is an integer >= 1")
        self.backend = make_backend(backend, model, host)
        limit = getattr(self.backend, "max_ctx", None)
        if n_ctx is not None and limit is not None and n_ctx > limit:
            self.backend.close()
            raise ValueError(f"n_ctx = {n_ctx} is past the {self.backend.name} backend's {limit} positions "
                             f"(HostConfig.max_ctx)")
        default = self.cfg.n_ctx_train or DEFAULT_CTX
        self.n_ctx = n_ctx or (min(default, limit) if limit is not None else default)
        self.scheduler = Scheduler(model, self.backend, host, Tracer(os.fspath(trace) if trace else None), exact, log)
        self.open_line = f"opened {model.file.path}: {self.scheduler.memory_line()}"
        if log is not None:
            log(self.open_line)
        self._loop: asyncio.AbstractEventLoop | None = None        # the sync wrappers' own loop
        if freeze_gc:
            gc.collect()                    # garbage cycles alive now would never be collected once frozen
            gc.freeze()
            self.scheduler.freeze_after = {"prefill", "decode", "mixed"}

    @classmethod
    def open_sync(cls, path: str | os.PathLike | None = None, *, exact: bool = False, backend: str | Backend = "cpu",
                  host: HostConfig = HostConfig(), trace: str | os.PathLike | None = None,
                  n_ctx: int | None = None, log: Callable[[str], None] | None = None,
                  freeze_gc: bool = True) -> "Engine":
        return cls(load_model(_resolve(path), exact=exact), exact=exact, backend=backend, host=host, trace=trace,
                   n_ctx=n_ctx, log=log, freeze_gc=freeze_gc)

    @classmethod
    async def open(cls, path: str | os.PathLike | None = None, *, exact: bool = False,
                   backend: str | Backend = "cpu", host: HostConfig = HostConfig(),
                   trace: str | os.PathLike | None = None, n_ctx: int | None = None,
                   log: Callable[[str], None] | None = None, freeze_gc: bool = True) -> "Engine":
        """Parse and check the file on a thread; the backend is made on the calling (loop) thread, which is where
        it will be called from (a CUDA context is per thread)."""
        model = await asyncio.to_thread(lambda: load_model(_resolve(path), exact=exact))
        return cls(model, exact=exact, backend=backend, host=host, trace=trace, n_ctx=n_ctx, log=log,
                   freeze_gc=freeze_gc)

    def check_tokens(self, tokens: Sequence[int]) -> list[int]:
        out = []
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < self.cfg.n_vocab:
                raise ValueError(f"token #{i} = {t!r} is not a token id in [0, {self.cfg.n_vocab})")
            out.append(int(t))
        if not out:
            raise ValueError("no tokens: give at least one")
        return out

    def logits(self, tokens: Sequence[int], dump: StageDump | None = None,
               progress: Callable[[int, int], None] | None = None, chunk: int = LOGITS_CHUNK) -> np.ndarray:
        """Teacher-forced logits, float32 (n_tokens, n_vocab): position i sees tokens[:i + 1]. The reference runs
        `chunk` tokens a step (1: token by token; any chunking gives the same logits)."""
        tokens = self.check_tokens(tokens)
        if chunk < 1:
            raise ValueError(f"chunk = {chunk}: a step holds at least one token")
        st = self.ref.new_state(dump)
        out = np.empty((len(tokens), self.cfg.n_vocab), np.float32)
        for a in range(0, len(tokens), chunk):
            b = min(len(tokens), a + chunk)
            out[a:b] = self.ref.chunk(st, tokens[a:b])
            if progress:
                progress(b, len(tokens))
        return out

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt: text is encoded (BOS first when the vocabulary asks for it), ids are checked."""
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:          # lone surrogates: bytes that were not UTF-8 (argv, JSON)
                raise ValueError(f"the prompt is not valid text: character {e.start} ({prompt[e.start]!r}) is not "
                                 f"UTF-8; give UTF-8 text or token ids") from None
            ids = self.tokenizer.encode(prompt)
            if self.tokenizer.add_bos:
                ids = [self.tokenizer.bos_id, *ids]
            prompt = ids
        return self.check_tokens(prompt)

    def check_context(self, n_prompt: int, max_tokens: int) -> None:
        """ContextLengthError unless a prompt of n_prompt tokens and max_tokens more fit the context."""
        if n_prompt + max_tokens > self.n_ctx:
            raise ContextLengthError(f"the context length is {self.n_ctx} tokens, but the request needs "
                                     f"{n_prompt + max_tokens} ({n_prompt} in the prompt, max_tokens {max_tokens}): "
                                     f"shorten the prompt, lower max_tokens or raise n_ctx (--ctx)")

    # ---- the async API -------------------------------------------------------------------------------------------
    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       progress: Callable[[int, int], None] | None = None) -> AsyncIterator[Chunk]:
        """Stream a completion: one Chunk per generated token, then a final Chunk with the finish reason.
        `progress(done, total)` is called as each chunk of the prompt is processed (a chunk shares its step with
        the other requests' rows). With stop strings a token's text may come with a later chunk (it could be the
        start of one); a stop string ends the stream ("stop") and neither it nor what follows is emitted."""
        params = params or SamplingParams()
        ids = self.prompt_ids(prompt)
        self.check_context(len(ids), params.max_tokens)
        bad = next((t for t in params.stop_token_ids if t >= self.cfg.n_vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: {bad} is not a token id in [0, {self.cfg.n_vocab})")
        req = self.scheduler.submit(ids, params, frozenset({self.tokenizer.eos_id, *params.stop_token_ids}))
        text = self.tokenizer.stream()
        stops = StopStrings(params.stop)
        try:
            while True:
                ev = await req.next()
                if isinstance(ev, Progress):
                    if progress:
                        progress(ev.done, ev.total)
                elif isinstance(ev, TokenOut):
                    piece, stopped = stops.push(text.push(ev.token))
                    yield Chunk(piece, ev.token, ev.index, len(ids), None, ev.timings, ev.logprobs)
                    if stopped:
                        yield Chunk("", None, ev.index + 1, len(ids), "stop", ev.timings)
                        return
                elif isinstance(ev, Finished):
                    piece, stopped = stops.push(text.flush())
                    yield Chunk(piece if stopped else piece + stops.flush(), None, ev.generated, len(ids),
                                "stop" if stopped else ev.reason, ev.timings)
                    return
        finally:
            self.scheduler.abort(req)

    async def score(self, tokens: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits (n_tokens, n_vocab) float32 computed by the token loop over the backend."""
        return await self.scheduler.score(self.check_tokens(tokens))

    async def preload_experts(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Read every expert blob into the host store (at most its budget stays), a layer at a time on the I/O
        pool, so that decoding starts with no expert read from disk; with a VRAM budget and a store that holds
        them all, decode rows then run as mapped tokens (HostConfig.map_experts). progress(bytes done, bytes
        in all) after each layer. Returns the bytes read."""
        s, n = self.scheduler, 0
        total = sum(s.layout.blob_bytes(il) for il in range(self.cfg.n_layer)) * self.cfg.n_expert
        for il in range(self.cfg.n_layer):
            for f in [s.store.fetch(il, x) for x in range(self.cfg.n_expert)]:
                n += (await asyncio.wrap_future(f)).nbytes
            if progress is not None:
                progress(n, total)
        return n

    def preload_experts_sync(self, progress: Callable[[int, int], None] | None = None) -> int:
        """preload_experts() for scripts (runs the engine's own event loop)."""
        return self._sync_loop().run_until_complete(self.preload_experts(progress))

    def flush_trace(self) -> None:
        """Block until every step record so far is in the trace file (records are written by a thread): for a
        reader of the file while the engine runs; closing the engine flushes too."""
        self.scheduler.tracer.flush()

    async def aclose(self) -> None:
        await self.scheduler.aclose()

    async def __aenter__(self) -> "Engine":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ---- the sync wrappers, for scripts --------------------------------------------------------------------------
    def _sync_loop(self) -> asyncio.AbstractEventLoop:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("generate_text/generate_iter block; inside async code use `async for chunk in "
                               "engine.generate(...)`")
        if self._loop is None:
            import uvloop
            self._loop = uvloop.new_event_loop()
        return self._loop

    def generate_iter(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                      progress: Callable[[int, int], None] | None = None) -> Iterator[Chunk]:
        """generate() as a plain iterator (runs the engine's own event loop while it waits)."""
        loop = self._sync_loop()
        agen = self.generate(prompt, params, progress=progress)
        try:
            while True:
                try:
                    yield loop.run_until_complete(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            loop.run_until_complete(agen.aclose())

    def generate_text(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> str:
        return "".join(c.text for c in self.generate_iter(prompt, params))

    def close(self) -> None:
        if self._loop is not None:
            self._loop.run_until_complete(self.scheduler.aclose())
            self._loop.close()
            self._loop = None
        else:
            self.scheduler.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
