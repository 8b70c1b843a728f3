"""The token loop: one driver task runs every request's token steps over a Backend, round-robin, one at a time.

One token step of one request:
    PLE: hash the token, start its 16 row reads (a prompt token's reads start one step earlier)
    begin(token); per layer l:
        [the PLE layer: wait for the rows, stage_ple]
        launch_pre(l); poll the doorbell (spin on sleep(0), then short sleeps; a timeout is an error)
        hits = resident(l, ids); the misses' blob reads start; misses split between the CPU pool and uploads
        parts = the CPU pool's outputs; launch_post(l, parts, mask); poll post_done
    launch_head; poll the logits; sample
Layer l's parts come from layer l's route and reach post[l] before pre[l+1] is launched, and a sequence never
has two stages in flight: the seed's stale-expert bug was post[l] combining layer l-1's experts.
The scheduler never touches device memory; it calls the backend from the event loop's thread only.
"""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from strata.host.backend import Backend, BackendError, Route
from strata.host.experts import CpuExpertPool, ExpertLayout, ExpertStore, MissCosts, VramCache
from strata.host.ple_io import PleReader
from strata.host.trace import KINDS, StepTrace, Tracer, clock
from strata.model.loader import Model
from strata.reference.common import F32
from strata.reference.ple import NgramWindow, ple_rows
from strata.sampling import Sampler, SamplingParams


class DoorbellTimeout(BackendError):
    """A stage never completed: the device is stuck or gone."""


class EngineError(RuntimeError):
    """A request failed because the engine did: the message says where, the cause is chained."""


class EngineClosed(EngineError):
    """The engine was closed, or stopped after a backend failure (named in the message)."""


@dataclass(frozen=True)
class PollPolicy:
    spin_s: float = 2e-3        # spin on sleep(0) this long first: most doorbells ring within a graph's ~0.5 ms
    sleep_s: float = 1e-4       # then sleep, doubling up to max_sleep_s, so a slow stage costs no CPU
    max_sleep_s: float = 2e-3
    timeout_s: float = 60.0     # a stage or read that never ends is an error, not a hang


TIMER_SLACK_S = 1.5e-3     # an event loop timer fires up to ~1 ms late (libuv's millisecond clock)


@dataclass(frozen=True)
class HostConfig:
    vram_budget_bytes: int = 24 << 30       # CUDA: device memory in use while strata runs: its CUDA context,
                                            # kernels, graphs and arena, and whatever else holds the GPU; the
                                            # arena (dense weights, KV, expert cache slots) gets what is left
    host_budget_bytes: int | None = None    # expert blobs kept in RAM; None: all experts, at most half the RAM
    cpu_threads: int | None = None          # CPU expert pool; None: one per core
    io_threads: int = 8                     # expert blob reads in flight at once
    max_ctx: int = 8192                     # CUDA: positions the device's KV cache holds (its memory is reserved)
    experts: str = "auto"                   # CUDA: "vram" (every expert uploaded at open, one graph per token),
                                            # "host" (the cache above), "auto": vram when the budget holds them
    poll: PollPolicy = PollPolicy()


@dataclass(frozen=True)
class Timings:
    """One request's speeds so far, and mean ms per token step by stage (trace span kinds and 'other')."""
    prefill_tok_s: float
    decode_tok_s: float
    stage_ms: dict[str, float]


# what a request's queue carries to its consumer (or an EngineError)
@dataclass(frozen=True)
class Progress:
    done: int               # prompt tokens processed
    total: int


@dataclass(frozen=True)
class TokenOut:
    token: int | None       # the sampled token; None when scoring
    index: int              # generated index; when scoring, the position
    logits: np.ndarray | None
    timings: Timings


@dataclass(frozen=True)
class Finished:
    reason: str             # "eos" | "length"
    generated: int
    timings: Timings


class _Aborted(Exception):
    pass


@dataclass(eq=False)
class Request:
    """One sequence's host state: its own backend sequence, n-gram window, sampler and output queue."""
    id: int
    prompt: list[int]
    sampler: Sampler | None          # None: score the prompt (teacher-forced logits), generate nothing
    max_tokens: int
    stop_ids: frozenset[int]
    queue: asyncio.Queue
    window: NgramWindow | None
    seq: object | None = None
    pos: int = 0                     # tokens fed so far
    next_token: int = -1
    generated: int = 0
    aborted: bool = False
    released: bool = False
    ple_ahead: dict[int, Future] = field(default_factory=dict)   # position -> its PLE rows in flight
    t_first: float = 0.0
    t_prefill: float = 0.0
    t_last: float = 0.0
    steps: int = 0
    stage_s: dict = field(default_factory=lambda: defaultdict(float))

    async def next(self):
        """The next event for the consumer; raises the engine's error if the request failed."""
        ev = await self.queue.get()
        if isinstance(ev, BaseException):
            raise ev
        return ev

    def timings(self) -> Timings:
        n = max(self.steps, 1)
        ms = {k: self.stage_s[k] * 1e3 / n for k in KINDS}
        ms["other"] = self.stage_s["total"] * 1e3 / n - sum(ms.values())
        pre = (self.t_prefill or self.t_last) - self.t_first
        # the first token comes from the prompt's last logits; each later one took a decode step
        dec = self.t_last - self.t_prefill if self.t_prefill else 0.0
        return Timings(min(self.pos, len(self.prompt)) / pre if pre > 0 else 0.0,
                       (self.generated - 1) / dec if self.generated > 1 and dec > 0 else 0.0, ms)


def _host_budget(layout: ExpertLayout, n_expert: int, budget: int | None) -> int:
    if budget is not None:
        return budget
    everything = sum(layout.blob_bytes(il) for il in range(len(layout.layers))) * n_expert
    return min(everything, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)


class Scheduler:
    """Sequences the backend's stages and the expert work for any number of requests; one driver task."""

    def __init__(self, model: Model, backend: Backend, host: HostConfig = HostConfig(), tracer: Tracer | None = None,
                 exact: bool = False):
        self.cfg, self.backend, self.host = model.cfg, backend, host
        self.poll = host.poll
        self.tracer = tracer or Tracer()
        self.layout = ExpertLayout.from_model(model)
        self.io = ThreadPoolExecutor(host.io_threads, thread_name_prefix="strata-io")
        # a backend that can DMA from host memory it allocated (CUDA: pinned cells) gives the blobs their memory
        self.store = ExpertStore(model.file.path, self.layout,
                                 _host_budget(self.layout, self.cfg.n_expert, host.host_budget_bytes), self.io,
                                 alloc=getattr(backend, "host_alloc", None))
        self.pool = CpuExpertPool(host.cpu_threads or os.cpu_count() or 1, exact)
        self.cache = VramCache(backend.expert_slots(), host.vram_budget_bytes)
        self.costs = MissCosts(self.cfg.n_layer)
        # every expert in VRAM (CudaBackend experts="vram"): a token is one graph, no per-layer host round trip
        self._token_s = 0.0               # running estimate of the whole-token graph's time (its wait)
        self.whole_token = (getattr(backend, "experts", None) == "vram" and getattr(backend, "graphs", False)
                            and hasattr(backend, "decode_token"))
        has_ple = bool(self.cfg.ple_layers)
        # PLE reads get their own thread: queued behind a layer's expert reads they would be late for layer 1
        self.ple = PleReader(model.file.path, model.file.tensor("per_layer_token_embd.weight"),
                             ThreadPoolExecutor(1, thread_name_prefix="strata-ple")) if has_ple else None
        self.ple_layer = self.cfg.ple_layers[0] if has_ple else -1
        self._active: deque[Request] = deque()
        self._current: Request | None = None
        self._live: set[Request] = set()
        self._ids = 0
        self._driver: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._closed: EngineClosed | None = None
        self._shut = False

    # ---- the API -------------------------------------------------------------------------------------------------
    @property
    def live(self) -> int:
        """Requests holding a backend sequence."""
        return len(self._live)

    @property
    def closed(self) -> EngineClosed | None:
        return self._closed

    def submit(self, prompt: list[int], params: SamplingParams | None, stop_ids: frozenset[int] = frozenset()) \
            -> Request:
        """Queue a request (in the running event loop). params None: score the prompt, one logits row per token."""
        if self._closed is not None:
            raise EngineClosed(str(self._closed))
        self._start_driver()
        self._ids += 1
        req = Request(self._ids, list(prompt), Sampler(params) if params else None,
                      params.max_tokens if params else 0, stop_ids if params and params.stop_at_eos else frozenset(),
                      asyncio.Queue(), NgramWindow.start(self.cfg) if self.ple else None)
        req.next_token = req.prompt[0]
        self._active.append(req)
        self._idle.clear()
        self._wake.set()
        return req

    def abort(self, req: Request) -> None:
        """Stop a request and free its state: now if the driver is not inside its step, else when the step's
        current stage completes (a stage in flight is never abandoned)."""
        if req.released:
            return
        req.aborted = True
        if req is not self._current:
            if req in self._active:
                self._active.remove(req)
            self._release(req)

    async def score(self, tokens: list[int]) -> np.ndarray:
        """Teacher-forced logits (n_tokens, n_vocab) float32 through the token loop."""
        req = self.submit(tokens, None)
        out = np.empty((len(tokens), self.cfg.n_vocab), F32)
        try:
            while True:
                ev = await req.next()
                if isinstance(ev, TokenOut):
                    out[ev.index] = ev.logits
                elif isinstance(ev, Finished):
                    return out
        finally:
            self.abort(req)

    async def idle(self) -> None:
        """Return when no request is queued or running."""
        if self._idle is not None:
            await self._idle.wait()

    async def aclose(self) -> None:
        task = self.shutdown()
        if task is not None and task.get_loop() is asyncio.get_running_loop():
            await asyncio.gather(task, return_exceptions=True)

    def shutdown(self) -> asyncio.Task | None:
        """Close: every open request gets EngineClosed, the driver is cancelled, resources are released."""
        if self._shut:
            return None
        self._shut = True
        if self._closed is None:
            self._closed = EngineClosed("the engine is closed")
        for req in list(self._active) + ([self._current] if self._current else []):
            self._deliver(req, self._closed)
            self._release(req)
        self._active.clear()
        task, self._driver = self._driver, None
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.cancel()
        # blobs in backend memory (pinned cells) are freed with the backend: let the CPU batch and the reads
        # running on them finish first (milliseconds); the queued ones are cancelled
        pinned = self.store.alloc is not None
        self.pool.close(wait=pinned)
        self.io.shutdown(wait=pinned, cancel_futures=True)
        self.backend.close()
        self.store.close()
        if self.ple:
            self.ple.pool.shutdown(wait=False, cancel_futures=True)
            self.ple.close()
        self.tracer.close()
        return task

    # ---- the driver ----------------------------------------------------------------------------------------------
    def _start_driver(self) -> None:
        loop = asyncio.get_running_loop()
        if self._driver is not None and not self._driver.done():
            old = self._driver.get_loop()
            if old is loop:
                return
            if not old.is_closed():
                raise RuntimeError("this engine's driver runs on another event loop; use the engine from one loop")
            for req in list(self._active) + ([self._current] if self._current else []):   # died with their loop
                self._release(req)
            self._active.clear()
            self._current = None
        self._wake, self._idle = asyncio.Event(), asyncio.Event()
        self._driver = loop.create_task(self._drive(), name="strata-driver")

    async def _drive(self) -> None:
        t_free = clock()                         # where the next step's time starts: the last one's end
        while True:
            if not self._active:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                t_free = clock()
                continue
            req = self._active.popleft()
            if req.seq is None and self.backend.max_seqs is not None and self.live >= self.backend.max_seqs:
                self._active.append(req)         # waits for a sequence; a live request is queued behind it
                continue
            self._current = req
            t_end = None
            try:
                done, t_end = await self._step(req, t_free)
            except _Aborted:
                done = True
            except BackendError as e:            # the device is gone: every stream gets it, the engine closes
                self._fail_all(req, e)
                self._closed = EngineClosed(f"the engine stopped: the {self.backend.name} backend failed: {e}")
                self._current = None
                self.shutdown()
                return
            except Exception as e:               # an I/O error (or a bug): every open stream gets it
                self._fail_all(req, e)
                done = True
            finally:
                self._current = None
            t_free = t_end or clock()     # the driver's timeline stays contiguous: emitting a trace is host time
            if done or req.aborted:
                self._release(req)
            else:
                self._active.append(req)

    def _fail_all(self, req: Request, e: BaseException) -> None:
        what = f"request {req.id} failed at position {req.pos}: {type(e).__name__}: {e}"
        for r in [req, *self._active]:
            err = EngineError(what if r is req else f"engine failure while serving another request ({what})")
            err.__cause__ = e
            self._deliver(r, err)
            self._release(r)
        self._active.clear()

    def _deliver(self, req: Request, ev) -> None:
        if not req.released:
            req.queue.put_nowait(ev)

    def _release(self, req: Request) -> None:
        if req.released:
            return
        req.released = True
        req.ple_ahead.clear()
        if req.seq is not None:
            seq, req.seq = req.seq, None
            self._live.discard(req)
            try:
                self.backend.free_seq(seq)
            except BackendError:
                pass                             # a failed backend's state is gone with it

    # ---- one token step ------------------------------------------------------------------------------------------
    async def _step(self, req: Request, t0: float) -> tuple[bool, float]:
        """Feed req.next_token; returns (whether the request is finished, when the step ended)."""
        if req.aborted:
            raise _Aborted
        if req.seq is None:
            req.seq = self.backend.new_seq()
            self._live.add(req)
            req.t_first = t0
        token, pos = req.next_token, req.pos
        st = StepTrace(req.id, pos, "prompt" if pos < len(req.prompt) else "decode", token, t0)
        logits = await self._forward(req, token, self._ple_reads(req, pos, token), st)
        if req.window is not None:
            req.window.advance(self.cfg, token)
        req.pos += 1
        t_s = clock()
        if req.pos == len(req.prompt):
            req.t_prefill = t_s
        done = self._after_token(req, logits, t_s)
        st.span("sample", -1, t_s, clock())
        st.t1 = req.t_last = clock()
        req.steps += 1
        req.stage_s["total"] += st.t1 - st.t0
        for k, v in st.by_kind().items():
            req.stage_s[k] += v
        if done:
            self._deliver(req, Finished(done, req.generated, req.timings()))
        self.tracer.emit(st)
        return bool(done), st.t1

    def _after_token(self, req: Request, logits: np.ndarray, now: float) -> str | None:
        """Emit what this token produced and pick the next one; the finish reason when the request is done."""
        n_prompt = len(req.prompt)
        if req.pos <= n_prompt:
            self._deliver(req, Progress(req.pos, n_prompt))
            if req.sampler is None:
                self._deliver(req, TokenOut(None, req.pos - 1, logits, req.timings()))
            if req.pos < n_prompt:
                req.next_token = req.prompt[req.pos]
                return None
            if req.sampler is None or req.max_tokens == 0:
                return "length"
        tok = req.sampler(logits)
        if tok in req.stop_ids:
            return "eos"
        req.t_last = now
        self._deliver(req, TokenOut(tok, req.generated, None, req.timings()))
        req.generated += 1
        req.next_token = tok
        return "length" if req.generated >= req.max_tokens else None

    def _ple_reads(self, req: Request, pos: int, token: int) -> Future | None:
        """This token's PLE rows in flight; a next prompt token is already known, so its reads start now too."""
        if self.ple is None:
            return None
        fut = req.ple_ahead.pop(pos, None) or self.ple.start(ple_rows(self.cfg, token, req.window.prev))
        if pos + 1 < len(req.prompt):
            nxt = NgramWindow(req.window.prev)
            nxt.advance(self.cfg, token)
            req.ple_ahead[pos + 1] = self.ple.start(ple_rows(self.cfg, req.prompt[pos + 1], nxt.prev))
        return fut

    async def _forward(self, req: Request, token: int, ple: Future | None, st: StepTrace) -> np.ndarray:
        be, seq = self.backend, req.seq
        if self.whole_token:
            return await self._forward_whole(req, token, ple, st)
        be.begin(seq, token, None)
        for il in range(self.cfg.n_layer):
            if il == self.ple_layer:
                rows = await self._wait(ple, st, "ple_wait", il, f"the PLE rows of token {token}")
                st.read("ple", rows.nbytes, rows.t0, rows.t1)
                be.stage_ple(seq, rows.e)
            t0 = clock()
            be.launch_pre(seq, il)
            t1 = clock()
            st.span("pre_launch", il, t0, t1)
            route = be.poll_route(seq, il) or await self._poll(lambda: be.poll_route(seq, il), "pre", il, seq)
            st.span("doorbell", il, t1, clock())
            parts, resident = await self._expert_parts(il, route, st)
            t0 = clock()
            be.launch_post(seq, il, parts, resident)
            t1 = clock()
            st.span("post_launch", il, t0, t1)
            be.post_done(seq, il) or await self._poll(lambda: be.post_done(seq, il) or None, "post", il, seq)
            st.span("post_wait", il, t1, clock())
            if req.aborted:                      # no stage in flight now: the request can go
                raise _Aborted
        t0 = clock()
        be.launch_head(seq)
        t1 = clock()
        st.span("head_launch", -1, t0, t1)
        logits = be.poll_logits(seq)
        if logits is None:
            logits = await self._poll(lambda: be.poll_logits(seq), "head", -1, seq)
        st.span("head_wait", -1, t1, clock())
        return logits

    async def _forward_whole(self, req: Request, token: int, ple: Future | None, st: StepTrace) -> np.ndarray:
        """Every expert resident in VRAM (CudaBackend experts="vram"): the token is one captured graph with no host
        round trip inside it; the PLE rows are awaited first because the graph's begin copies them."""
        be, seq = self.backend, req.seq
        ple_e = None
        if ple is not None:
            rows = await self._wait(ple, st, "ple_wait", self.ple_layer, f"the PLE rows of token {token}")
            st.read("ple", rows.nbytes, rows.t0, rows.t1)
            ple_e = rows.e
        t0 = clock()
        be.decode_token(seq, token, ple_e)
        t1 = clock()
        st.span("token_launch", -1, t0, t1)
        # the graph takes about as long as the last ones did: sleep through most of it (the loop's timers are
        # ~1 ms coarse), then poll; a backoff alone would overshoot a 9 ms graph by up to its last sleep
        if self._token_s > 2 * TIMER_SLACK_S:
            await asyncio.sleep(self._token_s - TIMER_SLACK_S)
        logits = be.poll_logits(seq)
        if logits is None:
            logits = await self._poll(lambda: be.poll_logits(seq), "token", -1, seq)
        t2 = clock()
        st.span("token_wait", -1, t1, t2)
        self._token_s = (t2 - t1) if self._token_s == 0 else 0.8 * self._token_s + 0.2 * min(t2 - t1, 2 * self._token_s)
        if req.aborted:
            raise _Aborted
        return logits

    async def _expert_parts(self, il: int, route: Route, st: StepTrace) -> tuple[np.ndarray, np.ndarray]:
        """Layer il's routed experts: VRAM hits stay with the backend, misses go to the CPU pool or get uploaded.
        Returns (parts (k, E) float32: the CPU rows filled, resident (k,) bool) for launch_post(il)."""
        be = self.backend
        hit = np.asarray(be.resident(il, route.ids), bool)           # (k,)
        ids, hits = route.ids.tolist(), hit.tolist()
        self.cache.record(il, ids, hits)
        parts = np.zeros((len(ids), self.cfg.n_embd), F32)           # (k, E): rows of resident experts unused
        miss = [j for j, h in enumerate(hits) if not h]
        if not miss:
            st.layer_experts(il, len(ids), len(ids), 0, 0, 0, 0)
            return parts, hit
        blobs = {j: self.store.fetch(il, ids[j]) for j in miss}      # reads start as soon as the route is known
        up: list[tuple[int, int]] = []                                # (row, slot)
        for j in miss[:self.costs.n_upload(il, len(miss), self.cache.slots > 0)]:
            slot = self.cache.place(il, ids[j], self.layout.blob_bytes(il), set(ids))
            if slot is None:
                break
            up.append((j, slot))
        cpu = miss[len(up):]
        t_cpu = clock()
        job = self.pool.run(self.layout.layers[il], route.x, [blobs[j] for j in cpu]) if cpu else None

        fetched_bytes, t_up = 0, clock()
        for j, slot in up:
            blob = await self._wait(blobs[j], st, "io_wait", il, f"expert {ids[j]} of layer {il}")
            self._trace_read(st, blob)
            t0 = clock()
            be.load_expert(il, ids[j], slot, blob.gate, blob.up, blob.down)
            st.span("upload", il, t0, clock())
            fetched_bytes += blob.nbytes
        if up:
            self.costs.observe_upload(il, len(up), clock() - t_up)

        cpu_bytes = 0
        if job is not None:
            res = await self._wait(job, st, "cpu_wait", il, f"the CPU experts of layer {il}")
            parts[cpu] = res.parts
            self.costs.observe_cpu(il, len(cpu), res.t1 - t_cpu)
            cpu_bytes = sum(b.nbytes for b in res.blobs)
            st.cpu_batch(il, len(cpu), cpu_bytes, res.t0, res.t1)
            for b in res.blobs:
                self._trace_read(st, b)
        if up:
            hit = np.asarray(be.resident(il, route.ids), bool)
            lost = [ids[j] for j, _ in up if not hit[j]]
            if lost:
                raise BackendError(f"layer {il}: experts {lost} were uploaded but the {be.name} backend does not "
                                   f"report them resident")
        st.layer_experts(il, len(ids), len(ids) - len(miss), len(cpu), len(up), cpu_bytes, fetched_bytes)
        return parts, hit

    @staticmethod
    def _trace_read(st: StepTrace, blob) -> None:
        r = blob.take_read()
        if r is not None:
            st.read("expert", blob.nbytes, *r)

    # ---- waiting without blocking the loop -----------------------------------------------------------------------
    async def _poll(self, poll, stage: str, layer: int, seq=None):
        """poll() until it gives something other than None: spin on sleep(0), then back off; time out. A backend
        whose device is a thread of this process (the CPU backend: in_flight(seq) gives the stage's future) wakes
        the loop when the stage ends instead: spinning there would take the GIL from the very work it waits for."""
        t0, delay = clock(), self.poll.sleep_s
        in_flight = getattr(self.backend, "in_flight", None)
        fut = in_flight(seq) if in_flight is not None and seq is not None else None
        if fut is not None:
            # asyncio.wait never cancels what it waits on: a cancelled request leaves the stage to finish
            await asyncio.wait([asyncio.wrap_future(fut)], timeout=self.poll.timeout_s)
            r = poll()
            if r is not None:
                return r
        while True:
            waited = clock() - t0
            if waited > self.poll.timeout_s:
                what = f"{stage}[{layer}]" if layer >= 0 else stage
                raise DoorbellTimeout(f"{what}: the {self.backend.name} backend did not complete it in "
                                      f"{self.poll.timeout_s:g} s")
            if waited < self.poll.spin_s:
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(delay)
                delay = min(2 * delay, self.poll.max_sleep_s)
            r = poll()
            if r is not None:
                return r

    async def _wait(self, fut: Future, st: StepTrace, kind: str, layer: int, what: str):
        """The result of a thread's future; the time the driver waited is a `kind` span."""
        if not fut.done():
            t0 = clock()
            try:
                async with asyncio.timeout(self.poll.timeout_s):
                    await asyncio.wrap_future(fut)
            except TimeoutError:
                raise TimeoutError(f"{what}: not ready after {self.poll.timeout_s:g} s") from None
            st.span(kind, layer, t0, clock())
        return fut.result()
