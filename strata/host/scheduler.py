"""The step loop: one driver task packs every live request into steps over a Backend (continuous batching).

Each step: the decoding requests' next tokens first, one row each, then prompt chunks (first come, first served)
until the step's token budget (HostConfig.step_tokens, at most the backend's max_step_tokens) is used; a new
request's prompt joins the running decodes at the next step. One step:
    PLE: hash the step's tokens, start their deduplicated row reads (a prompt's next chunk is read a step early)
    begin(step); per layer l:
        [the PLE layer: wait for the rows, stage_ple]
        launch_pre(l); poll the doorbell (spin on sleep(0), then short sleeps; a timeout is an error)
        plan the layer's experts for the whole step, grouped by expert: hits = resident(l, experts); the misses'
        blob reads start; misses split between the CPU pool and uploads; launch_post(plan), and pre[l+1] is
        launched right behind it (the device runs them in order: the next doorbell says post[l] is done)
    launch_head; poll the logits of the rows that need them; sample per request
Layer l's plan carries l and reaches post[l] before pre[l+1] is launched, and a step never has two stages in
flight: the seed's stale-expert bug was post[l] combining layer l-1's experts.
The scheduler never touches device memory; it calls the backend from the event loop's thread only.
Failures: the backend's end every stream and close the engine; a step's own (an I/O error, the CPU pool) end the
requests in that step; a request's own (its sampler) end that request only.
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from strata.host.backend import (MAPPED_READS, PREFETCH_EXTRA_MAX, Backend, BackendError, ExpertPlan, Route, Segment,
                                 Step)
from strata.host.direct_io import ram_bytes, rss_bytes
from strata.host.experts import CpuExpertPool, ExpertLayout, ExpertStore, MissCosts, VramCache
from strata.host.ple_io import PLE_CACHE, PleReader
from strata.host.prefix import Prefix, PrefixCache
from strata.diagnose import first_nonfinite
from strata.host.trace import KINDS, StepTrace, Tracer, clock
from strata.model.loader import Model
from strata.reference.common import F32
from strata.reference.ple import NgramWindow, ple_rows
from strata.sampling import Sampler, SamplingParams, TokenLogprobs


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


H2D_BYTES_PER_S = 25e9     # an upload's copy rate where the backend measured none (PCIe 4 x16 from pinned memory)


def _size_class(T: int) -> int:
    """Steps whose costs are kept together: T rounded up to a power of two."""
    return 1 << max(T - 1, 0).bit_length()


STREAM_SURE = 4            # routes per expert from which a step streams without trying the split
MODE_RETRY = 32            # every this many choices between two measured modes (times their cost ratio), the
                           # costlier is measured again (a first measurement on a cold cache must not decide for good)
STEP_TOKENS = 512          # rows a step carries at most, by default (HostConfig.step_tokens = None) ...
STEP_TOKENS_VRAM = 4096    # ... and on CUDA: a 4096-row chunk's graph runs ~2x the rows per second of a 512-row
                           # one on the H200 (bench/RESULTS.md, bench_prefill_gpu.py); under a budget its 5.8 GB
                           # of activations (flash) are cache slots between batched steps (lent_slots), and a 4K
                           # prompt prefilled 2.3x faster (each chunk streams every layer's experts once)
                           # 8192-row steps under 24 GiB (`--step-tokens 8192`): the 32K prompt 3,354 -> 3,808
                           # tok/s, the 8K 3,550 -> 3,903, but the 4K 3,672 -> 3,491 and decode right after an
                           # 8K prompt 9.98 -> 11.40 ms a token (H100, one run each: bench/RESULTS.md seventeenth
                           # session): the larger section of lent activations leaves fewer slots that keep their
                           # experts through a prompt, so the default stays 4096 for every placement
RAMP_FIRST = 512           # where PLE rows are read from the file, a prompt's first chunk at most this many rows;
                           # then each chunk doubles, up to step_tokens: a chunk waits for its PLE rows (4 KiB each,
                           # ~41K a second at depth 32 on the H200's disk: 0.2 s for 512 tokens, 1.6 s for 4096), and
                           # each later chunk's are read while the one before computes, so only the first's are exposed
STREAM_AHEAD = 2           # a streamed step reads the experts of this many layers ahead of the one being copied
STREAM_LAG = 2             # ... and launches pre[l] once post[l - STREAM_LAG] has run: the device always has a
                           # layer queued (~20 ms at 4096 rows of flash), the driver's queues stay short
TIMER_SLACK_S = 1.5e-3     # an event loop timer fires up to ~1 ms late (libuv's millisecond clock)
PLE_ANNOUNCE = 1 << 30     # a whole PLE table this large is announced before it is read (seconds at open)


def next_sleep_estimate(est: float, took: float, ready: bool) -> float:
    """The next whole-step graph's expected wait (seconds) after one that took `took` against the estimate `est`.
    `ready`: its logits were there at the first poll after the sleep, so the sleep itself set `took` and the graph
    ended some unknown time before: the estimate comes down by a tenth until a poll finds the graph running
    (blending `took` in would keep any estimate that was once too high, as one slow step after a prompt left the
    24 GiB decode sleeping 19.5 ms through 14 ms graphs). Otherwise the wait measured the graph: blended in,
    clamped to twice the estimate so one stall does not throw it off."""
    if est == 0:
        return took
    if ready:
        return 0.9 * est
    return 0.8 * est + 0.2 * min(took, 2 * est)


def retry_interval(best: float, other: float) -> int:
    """Choices between retries of the costlier of two measured modes: MODE_RETRY times their cost ratio (at most
    16), so that a retry adds about 1/MODE_RETRY to the wall however much costlier the other mode is (a split
    retry among mapped tokens costs ~3 tokens' time)."""
    ratio = other / best if best > 0 else 16.0
    return MODE_RETRY * int(min(16, max(1, round(ratio))))


@dataclass(frozen=True)
class HostConfig:
    vram_budget_bytes: int = 24 << 30       # CUDA: device memory in use while strata runs: its CUDA context,
                                            # kernels, graphs and arena, and whatever else holds the GPU; the
                                            # arena (dense weights, KV, expert cache slots) gets what is left
    host_budget_bytes: int | None = None    # the RAM tier: expert blobs kept in host memory (an LRU; misses are
                                            # read from the file); None: all experts, at most half the RAM
    ple_cache_bytes: int | None = None      # PLE table rows kept in RAM: a hot-row cache of this size (0: every
                                            # row is read from the file); at least the table's size: the whole
                                            # table, read at open. None: the whole table when it takes at most a
                                            # quarter of the RAM, else PLE_CACHE (strata.host.ple_io)
    direct_io: bool = True                  # file reads (expert blobs, PLE rows) with O_DIRECT, past the page
                                            # cache; False, or a filesystem that refuses it: buffered pread
    cpu_threads: int | None = None          # CPU expert pool; None: one per core
    io_threads: int = 32                    # reads in flight at once (queue depth), for expert blobs and again
                                            # for PLE blocks
    max_ctx: int = 8192                     # CUDA: positions the device's KV cache holds (its memory is reserved)
    experts: str = "auto"                   # CUDA: "vram" (every expert uploaded at open, one graph per token),
                                            # "host" (the cache above), "auto": vram when the budget holds them;
                                            # CPU: "mapped" or "vram" (the backend computes them from the
                                            # mapped file), "host" (the CPU pool over the host store), "auto":
                                            # mapped when they fit half the RAM and host_budget_bytes
    step_tokens: int | None = None          # rows per step at most (decode rows, then prompt chunks); the
                                            # backend's max_step_tokens caps it. None: STEP_TOKENS_VRAM on CUDA
                                            # (halved down to 512 while a budget cannot hold its activations),
                                            # else STEP_TOKENS
    prefix_cache_bytes: int = 1 << 30       # sequence-state snapshots kept for prefix reuse (LRU); 0: none. Only
                                            # a backend that can copy its state (snapshot / restore) takes them
    prefetch: str = "off"                   # while layer l's experts are planned, start reading layer l + 1's
                                            # likely experts (those not in VRAM or RAM): "previous", the ones it
                                            # used in the previous step; "router", the top k of its router applied
                                            # to layer l's MoE input; a wrong guess costs a read, never a wrong
                                            # result. Measured on the 2-vCPU VM: bench/RESULTS.md
    stream_experts: str = "auto"            # a step of several rows under a VRAM budget: "auto" streams every
                                            # expert a layer lacks in VRAM through a double buffer (layer l + 1
                                            # copied while layer l computes) for rows that reach most experts
                                            # (Scheduler._streams: by the rows' reach, then by the measured time
                                            # per row of each mode against splitting the misses between the CPU
                                            # pool and uploads); "always", "never". A prompt evicts nothing from
                                            # the cache (it fills free slots)
    map_experts: str = "auto"               # a decode row under a VRAM budget with every expert in pinned host
                                            # memory (the RAM tier holds them all): "auto" runs it as one graph
                                            # whose expert kernels read the VRAM cache's experts in place and the
                                            # rest from host memory over PCIe (no per-layer host round trip; the
                                            # misses are promoted into the cache while the next token runs), or
                                            # layer by layer (split) if that measures faster per token; "always",
                                            # "never"
    mapped_reads: str = "prefetch"          # how a mapped token's expert kernels get its misses: "fetch", a
                                            # kernel on every SM copies a layer's misses into VRAM staging first;
                                            # "prefetch", the same, and the next layer's router applied to this
                                            # layer's MoE input predicts its experts, whose misses are fetched
                                            # beside this layer's compute (the trace gives the hit rate; the
                                            # 24 GiB graph 8.6 ms against fetch's 10.9 on an H100,
                                            # bench/RESULTS.md); "direct", the expert kernels read them over
                                            # PCIe themselves
    prefetch_extra: int = 0                 # "prefetch": the prediction keeps this many experts beyond the top k
                                            # (more misses predicted for PCIe bytes beside the compute)
    promote_per_layer: int | None = None    # a mapped token's misses promoted into the VRAM cache while the next
                                            # token runs, at most this many per layer (None: every one the cache
                                            # takes); the copies share PCIe with that token's in-place reads
    cache_half_life: int = 512              # ... and only those more popular than the cache's least recently used
                                            # expert, the one a promotion evicts: the cache counts every expert's
                                            # routes, a route this many tokens old worth half a new one. A copy
                                            # shares PCIe with the next token's own reads, so one-off routes are
                                            # not copied (VramCache; bench/RESULTS.md, "twelfth session")
    poll: PollPolicy = PollPolicy()

    def __post_init__(self):
        for name in ("stream_experts", "map_experts"):
            if getattr(self, name) not in ("auto", "always", "never"):
                raise ValueError(f"HostConfig.{name} = {getattr(self, name)!r}: 'auto', 'always' or 'never'")
        if self.mapped_reads not in MAPPED_READS:
            raise ValueError(f"HostConfig.mapped_reads = {self.mapped_reads!r}: one of {', '.join(MAPPED_READS)}")
        if self.prefetch not in ("previous", "router", "off"):
            raise ValueError(f"HostConfig.prefetch = {self.prefetch!r}: 'previous', 'router' or 'off'")
        if self.step_tokens is not None and self.step_tokens < 1:
            raise ValueError(f"HostConfig.step_tokens = {self.step_tokens}: a step holds at least one token")
        if self.promote_per_layer is not None and self.promote_per_layer < 0:
            raise ValueError(f"HostConfig.promote_per_layer = {self.promote_per_layer}: 0 or more, or None")
        if self.cache_half_life < 1:
            raise ValueError(f"HostConfig.cache_half_life = {self.cache_half_life}: 1 token or more")
        if not 0 <= self.prefetch_extra <= PREFETCH_EXTRA_MAX:
            raise ValueError(f"HostConfig.prefetch_extra = {self.prefetch_extra}: 0 .. {PREFETCH_EXTRA_MAX}")


@dataclass(frozen=True)
class Timings:
    """One request's speeds so far, and mean ms per step it took part in, by stage (trace span kinds and
    'other')."""
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
    logprobs: TokenLogprobs | None = None     # the sampler's, when its params ask for them


@dataclass(frozen=True)
class Finished:
    reason: str             # "eos" | "length"
    generated: int
    timings: Timings


@dataclass
class _PleRead:
    """Table rows in flight for some steps' rows: rows (n, heads) of n tokens, read once per distinct row."""
    rows: np.ndarray
    fut: Future                      # PleRows, vec: the rows gathered per token (on the PLE thread for a chunk)

    @classmethod
    def start(cls, reader: PleReader, rows: np.ndarray) -> "_PleRead":
        uniq, inv = np.unique(rows, return_inverse=True)
        return cls(rows, reader.start(uniq, gather=inv.reshape(rows.shape)))


@dataclass(eq=False)
class Request:
    """One sequence's host state: its own backend sequence, n-gram window, sampler and output queue."""
    id: int
    prompt: list[int]
    sampler: Sampler | None          # None: score the prompt (teacher-forced logits), generate nothing
    max_tokens: int
    stop_ids: frozenset[int]
    queue: asyncio.Queue
    window: NgramWindow | None       # the n-gram window after the tokens fed so far
    seq: object | None = None
    fed: list[int] = field(default_factory=list)      # the tokens fed so far (the key of a snapshot of its state)
    reused: int = 0                  # prompt tokens a snapshot gave it (not computed)
    next_token: int = -1             # decoding: the token the next step feeds
    generated: int = 0
    aborted: bool = False
    released: bool = False
    ple_ahead: tuple | None = None   # (first position, _PleRead): the prompt's next chunk's rows in flight
    t_first: float = 0.0
    t_prefill: float = 0.0
    t_last: float = 0.0
    steps: int = 0
    stage_s: dict = field(default_factory=lambda: defaultdict(float))

    @property
    def pos(self) -> int:
        """Tokens fed so far."""
        return len(self.fed)

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.prompt)

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
        return Timings((min(self.pos, len(self.prompt)) - self.reused) / pre if pre > 0 else 0.0,
                       (self.generated - 1) / dec if self.generated > 1 and dec > 0 else 0.0, ms)


class Scheduler:
    """Packs every request's tokens into steps and sequences the backend's stages and the expert work; one driver
    task."""

    def __init__(self, model: Model, backend: Backend, host: HostConfig = HostConfig(), tracer: Tracer | None = None,
                 exact: bool = False, log=None):
        """log(line): long work at open is announced through it (reading the whole PLE table)."""
        self.cfg, self.backend, self.host = model.cfg, backend, host
        self.model = model
        self.poll = host.poll
        self.tracer = tracer or Tracer()
        self.layout = ExpertLayout.from_model(model)
        self.io = ThreadPoolExecutor(host.io_threads, thread_name_prefix="strata-io")
        # a backend that can DMA from host memory it allocated (CUDA: pinned cells) gives the blobs their memory
        self.store = ExpertStore(model.file.path, self.layout, host.host_budget_bytes, self.io,
                                 alloc=getattr(backend, "host_alloc", None), direct=host.direct_io,
                                 n_expert=self.cfg.n_expert)
        self.pool = CpuExpertPool(host.cpu_threads or os.cpu_count() or 1, exact)
        self.lent = getattr(backend, "lent_slots", lambda: 0)()    # fixed with the backend (Backend.lent_slots)
        self.cache = VramCache(backend.expert_slots(), host.vram_budget_bytes, self.cfg.n_layer, self.cfg.n_expert,
                               host.cache_half_life)
        self.costs = MissCosts(self.cfg.n_layer)
        # host-to-device copy rate of an upload from pinned memory (the CUDA backend measures it at open)
        self.h2d_bps = getattr(backend, "h2d_bytes_per_s", None) or H2D_BYTES_PER_S
        self._mode_cost: dict[int, dict[str, float]] = {}   # step size class -> {mode: wall seconds per row}
        self._mode_picks: dict[int, int] = defaultdict(int)   # size class -> choices made by measured cost
        self._mode_last: dict[int, str] = {}                  # size class -> the mode its last step took
        self.chunk_modes: dict[str, int] = defaultdict(int)   # steps of several rows by how their experts went
        self.decode_modes: dict[str, int] = defaultdict(int)  # one-row steps likewise (split or mapped)
        self.prefetch_on = host.prefetch != "off"
        self.freeze_after: set[str] = set()      # step kinds after whose first step gc.freeze() runs (Engine's)
        self._routed_prev: list[np.ndarray | None] = [None] * self.cfg.n_layer   # "previous": each layer's experts
        cap = getattr(backend, "max_step_tokens", None)         # CUDA: what make_backend opened it with
        want = host.step_tokens or cap or STEP_TOKENS
        self.step_tokens = min(want, cap) if cap else want
        # a scoring chunk asks logits for every row: the backend may give fewer a step (the CUDA head's buffer)
        self.logit_rows = getattr(backend, "max_logit_rows", None) or self.step_tokens
        # every expert in VRAM (CudaBackend experts="vram"): a step is one graph, no per-layer host round trip
        # running estimates of the whole-step graph's time (its wait), per step size: a prompt chunk's graph takes
        # hundreds of times a decode row's
        self._whole_s: dict[int, float] = {}
        self.whole = (getattr(backend, "experts", None) == "vram" and getattr(backend, "graphs", False)
                      and hasattr(backend, "launch_whole"))
        # mapped decode rows (HostConfig.map_experts): the backend maps the blobs once the RAM tier holds them all
        self._can_map = host.map_experts != "never" and hasattr(backend, "map_experts")
        self._mapped = False
        self._map_routes: tuple[np.ndarray, np.ndarray] | None = None    # the last mapped token's, to promote
        has_ple = bool(self.cfg.ple_layers)
        # PLE reads get their own thread: queued behind a layer's expert reads they would be late for layer 1
        self.ple = None
        if has_ple:
            table = model.file.tensor("per_layer_token_embd.weight")
            budget = host.ple_cache_bytes
            if budget is None:
                budget = table.nbytes if table.nbytes <= ram_bytes() // 4 else PLE_CACHE
            whole = budget >= table.nbytes             # the whole table in RAM: no hot-row cache beside it
            self.ple = PleReader(model.file.path, table, ThreadPoolExecutor(1, thread_name_prefix="strata-ple"),
                                 direct=host.direct_io, cache_bytes=0 if whole else budget, threads=host.io_threads)
        self.ple_layer = self.cfg.ple_layers[0] if has_ple else -1
        self.prefixes = (PrefixCache(host.prefix_cache_bytes)
                         if host.prefix_cache_bytes > 0 and hasattr(backend, "snapshot") else None)
        self._active: deque[Request] = deque()
        self._current: list[Request] = []         # the requests of the step in flight
        self._live: set[Request] = set()
        self._ids = 0
        self._steps = 0
        self._holding = False                     # _deliver holds events for the step's tail (_held, in order)
        self._held: list[tuple[Request, object]] = []
        self._tail = None                         # the last step's tail, run after the next launch
        self._tail_error: Exception | None = None  # a tail that failed outside a step: the next step fails with it
        self._mapped_tail = None                  # a mapped token's counts, for its step's tail
        self._driver: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._closed: EngineClosed | None = None
        self._shut = False
        self._diagnoses: set[asyncio.Task] = set()     # errors on their way to released requests
        if self.ple is not None and whole:
            if log is not None and table.nbytes >= PLE_ANNOUNCE:
                log(f"reading the PLE table whole into RAM ({table.nbytes / 2**30:.1f} GiB; --ple-cache-mib "
                    f"{PLE_CACHE >> 20} keeps a hot-row cache instead)")
            try:
                self.ple.load_table()
            except BaseException:            # a read error at open: the backend, pools and files are released
                self.shutdown()
                raise

    # ---- the API -------------------------------------------------------------------------------------------------
    @property
    def live(self) -> int:
        """Requests holding a backend sequence."""
        return len(self._live)

    @property
    def closed(self) -> EngineClosed | None:
        return self._closed

    def _lent_note(self) -> str:
        return (f" ({self.lent} of them the stream buffers' and the batched step's activations', the cache's "
                f"between steps of several rows)" if self.lent else "")

    def memory_line(self) -> str:
        """The tiers' budgets, how the file is read, and the process's memory now and at its peak (resident
        memory: the page cache is not counted, and O_DIRECT leaves nothing in it to count on)."""
        gib, mib, m, s = 1 << 30, 1 << 20, rss_bytes(), self.store
        where = getattr(self.backend, "experts", "host")
        tier = (f"experts all resident in the {self.backend.name} backend ({where})" if where in ("mapped", "vram")
                else f"experts: {self.cache.slots} VRAM slots{self._lent_note()}, RAM tier {s.budget / gib:.2f} GiB, "
                     f"then the file")
        ple = "" if self.ple is None else (
            f"; PLE table in RAM {self.ple.table_bytes / mib:.0f} MiB" if self.ple.table is not None
            else f"; PLE hot-row cache {getattr(self.ple.cache, 'nbytes', 0) / mib:.0f} MiB")
        return (f"{tier}{ple}; reads: {s.file.mode}; RSS {m.get('rss', m['peak']) / gib:.2f} GiB (anonymous "
                f"{m.get('anon', 0) / gib:.2f}, mapped file {m.get('file', 0) / gib:.2f}), peak {m['peak'] / gib:.2f} "
                f"GiB")

    def submit(self, prompt: list[int], params: SamplingParams | None, stop_ids: frozenset[int] = frozenset()) \
            -> Request:
        """Queue a request (in the running event loop). params None: score the prompt, one logits row per token."""
        if self._closed is not None:
            raise EngineClosed(str(self._closed))
        if not prompt:
            raise ValueError("no tokens: give at least one")
        bad = next((t for t in prompt if not 0 <= t < self.cfg.n_vocab), None)
        if bad is not None:                      # the request's own error, before it can reach the device
            raise ValueError(f"token id {bad} is not in [0, {self.cfg.n_vocab})")
        self._start_driver()
        self._ids += 1
        req = Request(self._ids, list(prompt), Sampler(params, prompt) if params else None,
                      params.max_tokens if params else 0, stop_ids if params and params.stop_at_eos else frozenset(),
                      asyncio.Queue(), NgramWindow.start(self.cfg) if self.ple else None)
        self._active.append(req)
        self._idle.clear()
        self._wake.set()
        return req

    def abort(self, req: Request) -> None:
        """Stop a request and free its state: now if it is not in the step in flight, else when that step ends (a
        step in flight is never abandoned: the other requests in it go on)."""
        if req.released:
            return
        req.aborted = True
        if req not in self._current:
            if req in self._active:
                self._active.remove(req)
            self._release(req)

    async def score(self, tokens: list[int]) -> np.ndarray:
        """Teacher-forced logits (n_tokens, n_vocab) float32 through the step loop."""
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
        """Return when no request is queued or running (at once after the engine closed)."""
        if self._idle is not None and not self._shut:
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
        self._run_tail(quiet=True)
        for req in {*self._active, *self._current}:
            self._deliver(req, EngineClosed(str(self._closed)))
            self._release(req)
        self._active.clear()
        task = self._driver
        if task is not None and not task.done():
            task.cancel()
        if self._idle is not None:
            self._idle.set()
        self.io.shutdown(wait=False, cancel_futures=True)
        self.pool.close()
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
            for req in {*self._active, *self._current}:      # died with their loop
                self._release(req)
            self._active.clear()
            self._current = []
        self._wake, self._idle = asyncio.Event(), asyncio.Event()
        self._driver = loop.create_task(self._drive(), name="strata-driver")

    async def _drive(self) -> None:
        t_free = clock()                         # where the next step's time starts: the last one's end
        while True:
            plan = self._plan_step()
            if not plan:
                self._run_tail(quiet=True)       # nothing to launch: the last step's deliveries go now
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                t_free = clock()
                continue
            self._current = [req for req, _, _ in plan]
            t_end = None
            try:
                t_end = await self._step(plan, t_free)
            except BackendError as e:            # the device is gone: every stream gets it, the engine closes
                self._run_tail(quiet=True)
                self._fail(list({*self._current, *self._active}), e)
                self._active.clear()
                self._closed = EngineClosed(f"the engine stopped: the {self.backend.name} backend failed: {e}")
                self._current = []
                self.shutdown()
                return
            except Exception as e:               # the step's own failure (an I/O error, the CPU pool): its requests
                self._run_tail(quiet=True)
                self._fail(self._current, e)
            finally:
                self._current = []
            t_free = t_end or clock()     # the driver's timeline stays contiguous: emitting a trace is host time
            for req, _, _ in plan:
                if req.aborted:
                    self._release(req)
            self._active = deque(r for r in self._active if not r.released)

    def _plan_step(self) -> list[tuple[Request, list[int], str]]:
        """This step's segments, by the policy: every decoding request's next token (round robin past the budget),
        then prompt chunks first come first served; [(request, tokens, which logits)]."""
        budget = self.step_tokens
        decoding = [r for r in self._active if r.seq is not None and not r.prefilling]
        plan = []
        for req in decoding[:budget]:
            plan.append((req, [req.next_token], "last"))
        served = {id(r) for r in decoding[:budget]}
        budget -= len(plan)
        for req in list(self._active):
            if budget == 0:
                break
            if not req.prefilling or req.aborted:
                continue
            if req.seq is None:
                if self.backend.max_seqs is not None and self.live >= self.backend.max_seqs:
                    continue                     # waits for a sequence
                self._new_seq(req)
            n = min(budget, self._chunk_cap(req), len(req.prompt) - req.pos,
                    self.logit_rows if req.sampler is None else budget)
            ends = req.pos + n == len(req.prompt)
            plan.append((req, req.prompt[req.pos:req.pos + n], "all" if req.sampler is None else
                         "last" if ends else "none"))
            served.add(id(req))
            budget -= n
        # the served go to the back: past the budget, the others get the next step
        self._active = deque([r for r in self._active if id(r) not in served] +
                             [r for r in self._active if id(r) in served])
        return plan

    def _chunk_cap(self, req: Request, ahead: int = 0) -> int:
        """The most rows of req's prompt chunk `ahead` chunks after its next one: RAMP_FIRST doubling per chunk up
        to step_tokens when the model's PLE rows are read from the file (req.steps counts the chunks fed while it
        prefills); with the table in RAM there is no read to hide, and a chunk is step_tokens rows from the first."""
        if self.ple is None or self.ple.table is not None or self.step_tokens <= RAMP_FIRST:
            return self.step_tokens
        return min(self.step_tokens, RAMP_FIRST << min(req.steps + ahead, 16))

    def _new_seq(self, req: Request) -> None:
        """A sequence for a request about to be fed: resumed from the longest snapshot its prompt starts with (a
        request that scores its prompt needs every position's logits, so it starts from nothing)."""
        hit = self.prefixes.longest(req.prompt) if self.prefixes is not None and req.sampler is not None else None
        if hit is None:
            req.seq = self.backend.new_seq()
        else:
            req.seq = self.backend.restore(hit.snap)
            req.fed, req.reused = list(hit.tokens), len(hit.tokens)
            req.window = None if hit.window is None else NgramWindow(hit.window.prev)
            self.tracer.prefix(req.id, len(hit.tokens), len(req.prompt))
        self._live.add(req)

    def _keep_prefix(self, req: Request) -> None:
        """Snapshot req's sequence (between steps) under the tokens it was fed."""
        if self.prefixes is None or req.seq is None:
            return
        key = tuple(req.fed)
        if key in self.prefixes:
            return
        snap, nbytes = self.backend.snapshot(req.seq)
        self.prefixes.put(Prefix(key, snap, None if req.window is None else NgramWindow(req.window.prev), nbytes))

    def _diagnose(self, req: Request, e: FloatingPointError) -> None:
        """Release req now; its error follows once the reference, fed what req was fed, has named the first layer
        and stage holding a non-finite value (one reference forward on a thread: the steps go on meanwhile)."""
        tokens, what = list(req.fed), f"request {req.id} failed at position {req.pos}: {type(e).__name__}: {e}"
        queue = req.queue
        self._release(req)

        async def tell() -> None:
            try:
                where = await asyncio.to_thread(first_nonfinite, self.model, tokens)
                why = (f"; the reference's first non-finite value: {where}" if where is not None else
                       f"; the reference stays finite on these tokens: the {self.backend.name} backend made them")
            except Exception as d:               # the diagnosis itself failed (the file went away...)
                why = f"; the reference could not say where ({type(d).__name__}: {d})"
            err = EngineError(what + why)
            err.__cause__ = e
            queue.put_nowait(err)
        task = asyncio.get_running_loop().create_task(tell())
        self._diagnoses.add(task)
        task.add_done_callback(self._diagnoses.discard)

    def _fail(self, reqs: list[Request], e: BaseException) -> None:
        """Each request gets its own error (one exception instance per stream) and is released."""
        self._flush_held()
        for r in reqs:
            err = EngineError(f"request {r.id} failed at position {r.pos}: {type(e).__name__}: {e}")
            err.__cause__ = e
            self._deliver(r, err)
            self._release(r)

    def _deliver(self, req: Request, ev) -> None:
        if req.released:
            return
        if self._holding:
            self._held.append((req, ev))
        else:
            req.queue.put_nowait(ev)

    @staticmethod
    def _put(events: list[tuple[Request, object]]) -> None:
        for req, ev in events:
            if not req.released:
                req.queue.put_nowait(ev)

    def _flush_held(self) -> None:
        held, self._held, self._holding = self._held, [], False
        self._put(held)

    # A step's tail: what it produced that the next launch does not need (the requests' tokens and progress handed
    # to their streams, their time accounts, the mapped token's cache counts, the trace record) runs after the next
    # step's first launch, while the device computes (the "tail" span), or at once when no step follows, a step
    # fails or a request finishes (its tokens then precede its end). The next token's launch waits only for its
    # sampling and its PLE rows.
    def _set_tail(self, fn) -> None:
        self._run_tail(quiet=True)
        self._tail = fn

    def _run_tail(self, st: StepTrace | None = None, quiet: bool = False) -> None:
        """quiet: outside a step (idle, a failed step, shutdown) a failure of the tail (the trace file's write) is
        kept for the next step, which fails with it, instead of ending the driver."""
        fn, self._tail = self._tail, None
        t0 = clock()
        try:
            if fn is not None:
                fn()
        except Exception as e:
            if not quiet:
                raise
            self._tail_error = e
        finally:
            self._flush_held()
            if st is not None and fn is not None:
                st.span("tail", -1, t0, clock())

    def _release(self, req: Request) -> None:
        if req.released:
            return
        req.released = True
        if req.ple_ahead is not None:
            req.ple_ahead[1].fut.cancel()        # a read not started yet is dropped; one running just ends
            req.ple_ahead = None
        if req.seq is not None:
            seq, req.seq = req.seq, None
            self._live.discard(req)
            try:
                self.backend.free_seq(seq)
            except BackendError:
                pass                             # a failed backend's state is gone with it

    # ---- one step ------------------------------------------------------------------------------------------------
    async def _step(self, plan: list[tuple[Request, list[int], str]], t0: float) -> float:
        """Run one step and hand each request what it produced; returns when the step ended."""
        self._steps += 1
        if self._tail_error is not None:         # the last step's records could not be written (the trace file)
            e, self._tail_error = self._tail_error, None
            raise e
        self.model.file.check_unchanged()        # a file changed under the engine fails this step's requests only
        st = StepTrace(self._steps, [[r.id, "prompt" if r.prefilling else "decode", len(t), r.pos]
                                     for r, t, _ in plan], t0)
        for req, _, _ in plan:
            if not req.t_first:
                req.t_first = t0
        step = Step(tuple(Segment(req.seq, tuple(toks), req.pos, mode) for req, toks, mode in plan))
        reads = self._ple_reads(plan)
        if self.whole:
            logits = await self._forward_whole(step, reads, st)
        elif self._maps(step):
            logits = await self._forward_mapped(step, reads, st)
        else:
            logits = await self._forward(step, reads, st)
        t_s = clock()
        at = 0                                   # next row of logits
        finished: list[tuple[Request, str]] = []
        accounts: list[Request] = []
        self._holding = True                     # the rows' events go with the tail (flushed before any end)
        for req, toks, mode in plan:
            n_logits = {"last": 1, "all": len(toks), "none": 0}[mode]
            rows, at = logits[at:at + n_logits], at + n_logits
            if req.window is not None:
                req.window.advance_all(self.cfg, toks)
            req.fed += toks
            if req.pos == len(req.prompt):
                req.t_prefill = req.t_prefill or t_s
                if req.sampler is not None:
                    self._keep_prefix(req)       # a later prompt that starts with this one resumes here
            req.steps += 1
            if req.aborted:
                continue
            try:
                done = self._after_rows(req, len(toks), rows, t_s)
            except FloatingPointError as e:      # non-finite logits: say where they came from, then fail it
                self._diagnose(req, e)
                continue
            except Exception as e:               # its own sampler: this request only
                self._fail([req], e)
                self._holding = True
                continue
            accounts.append(req)
            if done:
                finished.append((req, done))
        held, self._held, self._holding = self._held, [], False
        t_f = clock()
        st.span("sample", -1, t_s, t_f)
        mapped_tail, self._mapped_tail = self._mapped_tail, None

        def records() -> None:
            if mapped_tail is not None:
                mapped_tail()
            for req in accounts:
                self._account(req, st, t_s)
            self.tracer.emit(st)
        if finished:                             # a request's end follows its tokens: no tail
            self._run_tail(quiet=True)
            for req in accounts:                 # its end's timings count this step
                self._account(req, st, t_s)
            accounts = []
            self._put(held)
            for req, done in finished:           # its own span: a snapshot of the state can take ~100 ms
                if req.sampler is not None:
                    self._keep_prefix(req)       # the conversation so far: the next turn starts with it
                self._deliver(req, Finished(done, req.generated, req.timings()))
                self._release(req)
            st.span("finish", -1, t_f, clock())
            st.t1 = clock()
            records()
        else:
            st.t1 = clock()
            self._set_tail(lambda: (self._put(held), records()))
        if st.kind in self.freeze_after:         # what the first step of a kind made lives for good (lazy
            self.freeze_after.discard(st.kind)   # imports, compiled kernels, captured graphs): out of the
            gc.freeze()                          # collector's full passes too (Engine(freeze_gc))
        return st.t1

    @staticmethod
    def _account(req: Request, st: StepTrace, now: float) -> None:
        req.stage_s["total"] += now - st.t0
        for k, v in st.by_kind().items():
            req.stage_s[k] += v

    def _after_rows(self, req: Request, n: int, logits: np.ndarray, now: float) -> str | None:
        """Emit what this request's rows produced and pick its next token; the finish reason when it is done."""
        n_prompt = len(req.prompt)
        if req.pos <= n_prompt:                              # a prompt chunk
            self._deliver(req, Progress(req.pos, n_prompt))
            if req.sampler is None:
                for i, row in enumerate(logits):
                    self._deliver(req, TokenOut(None, req.pos - n + i, row, req.timings()))
            if req.pos < n_prompt:
                return None
            if req.sampler is None or req.max_tokens == 0:
                return "length"
        tok = req.sampler(logits[-1])
        if tok in req.stop_ids:
            return "eos"
        req.t_last = now
        self._deliver(req, TokenOut(tok, req.generated, None, req.timings(), req.sampler.logprobs))
        req.generated += 1
        req.next_token = tok
        if req.generated >= req.max_tokens:
            return "length"
        if self.ple is not None:       # the next row's PLE rows start reading now, before this step's bookkeeping
            req.ple_ahead = (req.pos, _PleRead.start(self.ple, ple_rows(self.cfg, [tok], req.window)))
        return None

    def _ple_reads(self, plan) -> list[tuple[_PleRead, int]] | None:
        """Each segment's PLE rows in flight as (read, first token of it in the read); a prompt whose next chunk
        is known has that chunk's reads started now too, a step early. Segments without such a read share one."""
        if self.ple is None:
            return None
        out: list = [None] * len(plan)
        fresh, fresh_rows = [], []
        for i, (req, toks, _) in enumerate(plan):
            ahead, req.ple_ahead = req.ple_ahead, None
            if ahead is not None and ahead[0] == req.pos and len(ahead[1].rows) >= len(toks):
                out[i] = (ahead[1], 0)
            else:
                fresh.append(i)
                fresh_rows.append(ple_rows(self.cfg, toks, req.window))
        if fresh:
            read = _PleRead.start(self.ple, np.concatenate(fresh_rows))
            at = 0
            for i, rows in zip(fresh, fresh_rows):
                out[i], at = (read, at), at + len(rows)
        for req, toks, _ in plan:                # the prompt's next chunk, at this step's chunk size
            end = req.pos + len(toks)
            if req.prefilling and end < len(req.prompt) and not req.aborted:
                nxt = NgramWindow(req.window.prev)
                nxt.advance_all(self.cfg, toks)
                more = req.prompt[end:end + self._chunk_cap(req, 1)]
                req.ple_ahead = (end, _PleRead.start(self.ple, ple_rows(self.cfg, more, nxt)))
        return out

    async def _ple_vectors(self, step: Step, reads, st: StepTrace) -> np.ndarray:
        """The step's gathered PLE vectors (T, ple_dim), once its reads are done: one segment's the read's own
        (no copy on the loop's thread), several segments' copied together."""
        e = None if len(reads) == 1 else np.empty((step.T, self.cfg.ple_dim), F32)
        seen = set()
        for (read, at), a, b in zip(reads, step.starts[:-1], step.starts[1:]):
            rows = await self._wait(read.fut, st, "ple_wait", self.ple_layer, "the PLE rows of the step")
            if id(read) not in seen:
                seen.add(id(read))
                st.ple_rows(len(rows.e), rows.hits)
                if rows.nbytes:
                    st.read("ple", rows.nbytes, rows.t0, rows.t1)
            if e is None:
                return rows.vec[at:at + b - a]
            e[a:b] = rows.vec[at:at + b - a]
        return e

    async def _forward(self, step: Step, reads, st: StepTrace) -> np.ndarray:
        self.cache.tick(step.T)
        stream = self._streams(step)
        lent = bool(self.lent) and step.T > 1
        if lent:                # what the step writes of the lent slots leaves the cache for it (Backend.lent_slots)
            taken = self.backend.take_lent(stream, step.T)
            if len(taken):
                self.cache.withdraw(taken)
        try:
            return await self._forward_layers(step, reads, st, stream)
        finally:
            if lent:
                self.backend.return_lent()
                self.cache.restore()

    async def _forward_layers(self, step: Step, reads, st: StepTrace, stream: bool) -> np.ndarray:
        be, n = self.backend, self.cfg.n_layer
        st.mode = "stream" if stream else "split"
        (self.chunk_modes if step.T > 1 else self.decode_modes)[st.mode] += 1
        t0 = t_begin = clock()
        be.begin(step, route_x=not stream)
        st.span("pre_launch", -1, t0, clock())
        fetches: dict[int, tuple] = {}
        tasks: dict[int, asyncio.Task] = {}
        streamed: dict[int, tuple] = {}   # a streamed layer's copies (the _stream tuple), counted after the step
        try:
            if stream:                   # layer l + 1's experts are copied while layer l computes; reads run ahead
                for il in range(min(STREAM_AHEAD, n)):
                    fetches[il] = self._stream_fetch(il)
                tasks[0] = asyncio.create_task(self._stream(0, fetches.pop(0), None, st))
            for il in range(n):
                if il == self.ple_layer:
                    be.stage_ple(await self._ple_vectors(step, reads, st))
                if stream and il >= STREAM_LAG and not be.post_done(il - STREAM_LAG):
                    t0 = clock()         # the host stays STREAM_LAG layers ahead of the device, no further
                    await self._poll(lambda lag=il - STREAM_LAG: be.post_done(lag) or None, "post", il - STREAM_LAG)
                    st.span("lag_wait", il - STREAM_LAG, t0, clock())
                t0 = clock()
                be.launch_pre(il)
                t1 = clock()
                st.span("pre_launch", il, t0, t1)
                if il == 0:
                    self._run_tail(st)         # the last step's deliveries and records, beside pre[0]
                    t1 = clock()
                if stream:    # post[il] needs its layer's copies enqueued, not its route: no doorbell round trip
                    if il + 1 < n:     # post[il - 1], the last reader of its buffer, is launched
                        if il + STREAM_AHEAD < n:
                            fetches[il + STREAM_AHEAD] = self._stream_fetch(il + STREAM_AHEAD)
                        tasks[il + 1] = asyncio.create_task(self._stream(il + 1, fetches.pop(il + 1), tasks[il], st))
                    streamed[il] = await tasks.pop(il)
                    t0 = clock()
                    st.span("stream_wait", il, t1, t0)
                    be.launch_post_streamed(il)
                    st.span("post_launch", il, t0, clock())
                    continue
                route = be.poll_route(il) or await self._poll(lambda: be.poll_route(il), "pre", il)
                st.span("doorbell", il, t1, clock())
                plan = await self._expert_plan(il, route, st)
                t0 = clock()
                be.launch_post(plan)
                st.span("post_launch", il, t0, clock())
        finally:
            for t in tasks.values():     # a failed step: the later layers' streams end with it
                if t.done() and not t.cancelled():
                    t.exception()        # retrieved: the step's own failure is the one that is raised
                t.cancel()
        t0 = clock()
        be.launch_head()
        t1 = clock()
        st.span("head_launch", -1, t0, t1)
        logits = be.poll_logits()
        if logits is None:
            logits = await self._poll(be.poll_logits, "head", -1)
        st.span("head_wait", -1, t1, clock())
        if stream:
            routes = be.streamed_routes()
            for il, got in streamed.items():
                self._streamed_counts(il, routes[il], got, st)
            st.stream = [(*t, 1e3 * streamed[t[0]][5] if t[0] in streamed else 0.0) for t in be.stream_times()]
        if step.T > 1 or self._mapped:   # what the mode cost: wall seconds per row, per size class
            self._observe(_size_class(step.T), st.mode, (clock() - t_begin) / step.T)
        return logits

    def _observe(self, size: int, mode: str, per_row: float) -> None:
        """A step's wall seconds per row in `mode`: a running mean while the mode repeats; a mode taken again after
        the other (its retry) starts from this measurement, its old one being stale."""
        costs = self._mode_cost.setdefault(size, {})
        old = costs.get(mode)
        fresh = old is None or self._mode_last.get(size) != mode
        costs[mode] = per_row if fresh else old + MissCosts.ALPHA * (per_row - old)
        self._mode_last[size] = mode

    # ---- streaming a step's experts ------------------------------------------------------------------------------
    def _streams(self, step: Step) -> bool:
        """Stream this step's experts (every expert a layer lacks in VRAM, copied while the layer before
        computes), or split each layer's misses between the CPU pool and uploads. Streaming copies experts no
        row routes to: a step whose rows reach under about two thirds of a layer's experts (T k < n_expert)
        splits; one whose rows give every expert STREAM_SURE routes on average (T k >= STREAM_SURE n_expert)
        streams, since a split would hand the CPU pool thousands of experts (seconds, not worth one trial);
        between the two, by measured cost: the wall time per row each mode took on steps of this size class,
        each tried once first."""
        be, cfg, mode = self.backend, self.cfg, self.host.stream_experts
        if mode == "never" or step.T < 2 or not getattr(be, "stream_slots", lambda: 0)():
            return False
        if mode == "always":
            return True
        reach = step.T * cfg.n_expert_used / cfg.n_expert
        if reach < 1 or reach >= STREAM_SURE:
            return reach >= 1
        return self._cheaper(_size_class(step.T), "stream", "split") == "stream"

    def _stream_fetch(self, il: int) -> tuple:
        """The reads of layer il's experts that the backend lacks, started now: (experts, futures, in RAM)."""
        lack = np.flatnonzero(~np.asarray(self.backend.resident(il, np.arange(self.cfg.n_expert)), bool)).tolist()
        futs, in_ram, _ = self.store.fetch_many(il, lack)
        return lack, futs, in_ram

    async def _stream(self, il: int, fetch: tuple, before: asyncio.Task | None, st: StepTrace) -> tuple:
        """Copy layer il's lacking experts into the backend's stream buffer as their blobs arrive, after layer
        il - 1's copies (the copy stream goes layer by layer); while the cache has free slots an expert goes to
        one of those instead (the same copy: the first prompt warms the cache, evicting nothing).
        (experts, bytes, from RAM, from the SSD, lacked experts, seconds inside the backend's stream calls: the
        copies' enqueue, during which the loop runs nothing else)."""
        experts, futs, in_ram = fetch
        if before is not None:
            await before
        be, cache = self.backend, self.cache
        t0 = clock()
        be.stream_open(il)
        drv = clock() - t0
        nbytes, blob_bytes, room = 0, self.layout.blob_bytes(il), cache.slots > len(cache)
        ready: list[tuple] = []             # blobs at hand go to the backend in one call, before a wait for more
        for e, f, ram in zip(experts, futs, in_ram.tolist()):
            if not f.done() and ready:
                t0 = clock()
                be.stream_experts(il, ready)
                drv += clock() - t0
                ready = []
            blob = f.result() if f.done() else await self._result(f, "expert %d of layer %d", e, il)
            if not ram:
                self._trace_read(st, blob)
            slot = cache.place(il, e, blob_bytes, set(), evict=False) if room else None
            room = slot is not None
            ready.append((e, blob.gate, blob.up, blob.down, slot))
            nbytes += blob.nbytes
        t0 = clock()
        be.stream_experts(il, ready)
        be.stream_close(il)
        drv += clock() - t0
        n_ram = int(in_ram.sum())
        return len(experts), nbytes, n_ram, len(experts) - n_ram, experts, drv

    def _streamed_counts(self, il: int, ids: np.ndarray, got: tuple, st: StepTrace) -> None:
        """A streamed layer's routes ids (T, k), read after the step: the cache's hits (the routed experts that
        were resident before this step's copies) and the trace's counts. A count per expert, not a grouping (a
        sort of a 4096-row chunk's 40,960 routes took ~4 ms)."""
        n, nbytes, n_ram, n_ssd, lacked, _ = got
        per = np.bincount(np.asarray(ids).reshape(-1), minlength=self.cfg.n_expert)
        experts = np.flatnonzero(per).astype(np.int32)
        pairs = per[experts]
        lack = np.zeros(self.cfg.n_expert, bool)
        lack[lacked] = True
        hit = ~lack[experts]
        self.cache.record(il, experts, hit, pairs)
        st.layer_experts(il, int(pairs.sum()), int(hit.sum()), 0, n, 0, nbytes, n_ram, n_ssd)

    async def _forward_whole(self, step: Step, reads, st: StepTrace, after_launch=None) -> np.ndarray:
        """Every expert resident in VRAM (CudaBackend experts="vram"), or a mapped decode row: the step is one
        captured graph with no host round trip inside it; the PLE rows are awaited first because the graph's
        begin copies them. after_launch(): host work done while the graph runs."""
        be = self.backend
        e = await self._ple_vectors(step, reads, st) if reads is not None else None
        t0 = clock()
        be.launch_whole(step, e)
        t1 = clock()
        st.span("token_launch", -1, t0, t1)
        self._run_tail(st)                             # the last step's deliveries and records, beside the graph
        if after_launch is not None:                   # after the records: a promotion ranks by routes counted
            after_launch()
        t1 = clock()
        # the graph takes about as long as the last ones did: sleep through most of it (the loop's timers are
        # ~1 ms coarse), then poll; a backoff alone would overshoot a 9 ms graph by up to its last sleep
        est = self._whole_s.get(step.T, 0.0)
        if est > 2 * TIMER_SLACK_S:
            await asyncio.sleep(est - TIMER_SLACK_S)
        logits = be.poll_logits()
        ready = logits is not None
        if not ready:
            logits = await self._poll(be.poll_logits, "token", -1)
        t2 = clock()
        st.span("token_wait", -1, t1, t2)
        self._whole_s[step.T] = next_sleep_estimate(est, t2 - t1, ready)
        return logits

    # ---- mapped decode rows ----------------------------------------------------------------------------------------
    def _maps(self, step: Step) -> bool:
        """Run this one-row step as a mapped token: once the RAM tier holds every expert (then the backend maps
        their blobs, once), by HostConfig.map_experts; "auto" by the measured wall per token of each mode (mapped
        tried first, the split once, then the cheaper)."""
        if step.T != 1 or not self._can_map:
            return False
        if not self._mapped:
            blobs = self.store.complete(self.cfg.n_expert)
            if blobs is None:
                return False
            self._mapped = bool(self.backend.map_experts(blobs))
            self._can_map = self._mapped         # a backend that cannot map them is not asked again
            if not self._mapped:
                return False
            self._blobs = blobs
            self._blob_bytes = [self.layout.blob_bytes(il) for il in range(self.cfg.n_layer)]
        if self.host.map_experts == "always":
            return True
        return self._cheaper(1, "mapped", "split") == "mapped"

    def _cheaper(self, size: int, first: str, second: str) -> str:
        """Of two modes for steps of this size class: an unmeasured one (`first` before `second`), else the one with
        the lower measured wall per row, except that every retry_interval-th choice takes the costlier one, so that its
        estimate follows the cache as it warms."""
        seen = self._mode_cost.get(size, {})
        for m in (first, second):
            if m not in seen:
                return m
        best, other = (first, second) if seen[first] <= seen[second] else (second, first)
        self._mode_picks[size] += 1
        return other if self._mode_picks[size] % retry_interval(seen[best], seen[other]) == 0 else best

    async def _forward_mapped(self, step: Step, reads, st: StepTrace) -> np.ndarray:
        """A decode row as one graph: each layer's routed experts are read by its kernels from the VRAM cache or,
        the misses, from their blobs in pinned host memory. While it runs, the previous mapped token's misses are
        promoted into the cache (their copies overlap this token; the backend serves a slot once its copy is done).
        The trace counts the misses as RAM-tier experts read over PCIe."""
        be, cfg = self.backend, self.cfg
        self.cache.tick(1)
        st.mode = "mapped"
        self.decode_modes["mapped"] += 1
        t_begin = clock()

        def promote():
            if self._map_routes is not None:
                routes, self._map_routes = self._map_routes, None
                t0 = clock()
                self._promote(*routes)
                st.span("promote", -1, t0, clock())
        logits = await self._forward_whole(step, reads, st, promote)
        timing = getattr(be, "mapped_timing", None)      # the device's side (CUDA; the CPU twin has no device)
        if timing is not None:
            t = timing()
            st.mapped_device(t["table_ms"], t["graph_ms"], t["promoted"])
        ids, res = be.token_routes()
        self._map_routes = (ids, res)                  # the LRU's recency is updated with the promotions
        pref = getattr(be, "token_prefetch", None)     # mapped_reads="prefetch" (CUDA)
        got = pref() if pref is not None else None
        self._observe(1, "mapped", clock() - t_begin)

        def counts() -> None:                          # the step's tail: what the device state was read for
            if got is not None:
                misses, predicted, fetched, nbytes = got
                st.prefetch_issued(fetched, nbytes)
                st.prefetch_used(misses, predicted)
            self.cache.count_token(ids, res)
            k = ids.shape[1]
            hits = res.sum(axis=1).tolist()
            st.experts.extend((il, k, h, 0, 0, 0, 0, k - h, 0) for il, h in enumerate(hits))
            st.mapped_read(cfg.n_layer * k - sum(hits),
                           sum((k - h) * self._blob_bytes[il] for il, h in enumerate(hits)))
        self._mapped_tail = counts
        return logits

    def _promote(self, ids: np.ndarray, res: np.ndarray) -> None:
        """A mapped token's misses into the VRAM cache (VramCache.promotions: ranked by popularity, at most
        HostConfig.promote_per_layer a layer), each copied from its pinned blob on the side stream."""
        be = self.backend
        for il, e, slot in self.cache.promotions(ids, res, self._blob_bytes,
                                                 lambda il, m: ~np.asarray(be.resident(il, m), bool),
                                                 self.host.promote_per_layer):
            blob = self._blobs[il][e]
            be.load_expert(il, e, slot, blob.gate, blob.up, blob.down)
        done = getattr(be, "loads_done", None)       # the token's promotions as one batch of copies
        if done is not None:
            done()

    async def _expert_plan(self, il: int, route: Route, st: StepTrace) -> ExpertPlan:
        """Layer il's routed experts for the step, grouped by expert: VRAM hits stay with the backend, each miss is
        read once, then computed by the CPU pool over its rows or uploaded. The plan for launch_post(il)."""
        be, k = self.backend, self.cfg.n_expert_used
        plan = ExpertPlan.of(il, route.ids, self.cfg.n_embd)
        if self.prefetch_on:
            self._prefetch(il + 1, route, st)
            if self.host.prefetch == "previous":
                self._routed_prev[il] = plan.experts
        pairs = np.diff(plan.offsets)                                 # (U,) rows each expert serves
        hit = np.asarray(be.resident(il, plan.experts), bool)         # (U,)
        self.cache.record(il, plan.experts, hit, pairs)
        n_routed = int(pairs.sum())
        miss = np.flatnonzero(~hit)
        if not miss.size:
            plan.resident = hit
            st.layer_experts(il, n_routed, len(hit), 0, 0, 0, 0)
            return plan
        experts = plan.experts.tolist()
        futs, in_ram, predicted = self.store.fetch_many(il, [experts[u] for u in miss.tolist()])  # reads start now
        in_ram &= ~predicted                      # a prefetched read came from the file for this use
        st.prefetch_used(len(miss), int(predicted.sum()))
        blobs = dict(zip(miss.tolist(), futs))
        n_ram = int(in_ram.sum())
        read_now = {u for u, r in zip(miss.tolist(), in_ram.tolist()) if not r}     # this step's SSD reads
        miss = miss[np.argsort(-pairs[miss], kind="stable")]          # the most-used misses are uploaded first
        up: list[tuple[int, int]] = []                                # (expert index u, slot)
        keep = set(experts)
        for u in miss[:self.costs.n_upload(il, pairs[miss], self.cache.slots > 0)].tolist():
            slot = self.cache.place(il, experts[u], self.layout.blob_bytes(il), keep)
            if slot is None:
                break
            up.append((u, slot))
        on_cpu = ~hit
        on_cpu[[u for u, _ in up]] = False
        cpu = np.flatnonzero(on_cpu).tolist()
        cpu_pairs = plan.pairs[np.repeat(on_cpu, pairs)]             # their (row * k + j) pairs, expert by expert
        job = self.pool.run(self.layout.layers[il], route.x, [blobs[u] for u in cpu],
                            np.concatenate([[0], np.cumsum(pairs[on_cpu])]), cpu_pairs // k) if cpu else None

        fetched_bytes, enqueue_s = 0, 0.0
        done = getattr(be, "loads_done", None)       # a backend that queues load_expert's copies sends them then
        for i, (u, slot) in enumerate(up):
            if done is not None and i and not blobs[u].done():     # the copies so far run while this blob is read
                t0 = clock()
                done()
                t1 = clock()
                st.span("upload", il, t0, t1)
                enqueue_s += t1 - t0
            blob = await self._wait(blobs[u], st, "io_wait", il, "expert %d of layer %d", experts[u], il)
            if u in read_now:
                self._trace_read(st, blob)
            t0 = clock()
            be.load_expert(il, experts[u], slot, blob.gate, blob.up, blob.down)
            if done is not None and i == len(up) - 1:
                done()
            t1 = clock()
            st.span("upload", il, t0, t1)
            enqueue_s += t1 - t0
            fetched_bytes += blob.nbytes
        if up:       # the read wait is either path's: an upload costs its enqueue and its DMA
            self.costs.observe_upload(il, len(up), enqueue_s + fetched_bytes / self.h2d_bps)

        cpu_bytes = 0
        if job is not None:
            res = await self._wait(job, st, "cpu_wait", il, "the CPU experts of layer %d", il)
            plan.parts.reshape(-1, self.cfg.n_embd)[cpu_pairs] = res.parts
            self.costs.observe_cpu(il, len(cpu_pairs), res.t1 - res.t0)     # from its first blob's arrival
            cpu_bytes = sum(b.nbytes for b in res.blobs)
            st.cpu_batch(il, len(cpu), cpu_bytes, res.t0, res.t1)
            for u, b in zip(cpu, res.blobs):
                if u in read_now:
                    self._trace_read(st, b)
        if up:
            hit = np.asarray(be.resident(il, plan.experts), bool)
            lost = [experts[u] for u, _ in up if not hit[u]]
            if lost:
                raise BackendError(f"layer {il}: experts {lost} were uploaded but the {be.name} backend does not "
                                   f"report them resident")
        plan.resident = hit
        st.layer_experts(il, n_routed, len(hit) - len(miss), len(cpu), len(up), cpu_bytes, fetched_bytes, n_ram,
                         len(miss) - n_ram)
        return plan

    def _prefetch(self, il: int, route: Route, st: StepTrace) -> None:
        """Start reading layer il's likely experts that the backend does not hold, while the layers before it run:
        those it routed to in the previous step ("previous"), or the top k of its router over the MoE input of
        the layer before (route.x: "router", the residual stream changes little from one layer to the next)."""
        if il >= self.cfg.n_layer:
            return
        if self.host.prefetch == "router":
            logits = self.model.weights.layers[il].ffn_gate_inp @ route.x           # (T, n_expert)
            k = self.cfg.n_expert_used
            cand = np.unique(np.argpartition(-logits, k - 1, axis=1)[:, :k])
        elif self._routed_prev[il] is None:
            return
        else:
            cand = self._routed_prev[il]
        cand = cand[~np.asarray(self.backend.resident(il, cand), bool)]
        if cand.size:
            st.prefetch_issued(self.store.prefetch(il, cand.tolist()))

    @staticmethod
    def _trace_read(st: StepTrace, blob) -> None:
        r = blob.take_read()
        if r is not None:
            t0, t1, nbytes = r
            st.read("expert", nbytes, t0, t1)

    # ---- waiting without blocking the loop -----------------------------------------------------------------------
    async def _poll(self, poll, stage: str, layer: int):
        """poll() until it gives something other than None: spin on sleep(0), then back off; time out. A backend
        whose device is a thread of this process (the CPU backend: in_flight() gives the stage's future) wakes
        the loop when the stage ends instead: spinning there would take the GIL from the very work it waits for."""
        t0, delay = clock(), self.poll.sleep_s
        in_flight = getattr(self.backend, "in_flight", None)
        fut = in_flight() if in_flight is not None else None
        if fut is not None:
            # asyncio.wait never cancels what it waits on: a cancelled request leaves the stage to finish
            w = asyncio.wrap_future(fut)
            await asyncio.wait([w], timeout=self.poll.timeout_s)
            if w.done() and not w.cancelled():
                w.exception()                    # retrieved: poll() below raises the stage's failure itself
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

    async def _wait(self, fut: Future, st: StepTrace, kind: str, layer: int, what: str, *args):
        """The result of a thread's future; the time the driver waited is a `kind` span."""
        if fut.done():
            return fut.result()
        t0 = clock()
        got = await self._result(fut, what, *args)
        st.span(kind, layer, t0, clock())
        return got

    async def _result(self, fut: Future, what: str, *args):
        """A thread's future's result, awaited without blocking the loop; a TimeoutError naming what % args
        (formatted only then) after the poll policy's timeout."""
        try:
            async with asyncio.timeout(self.poll.timeout_s):
                await asyncio.wrap_future(fut)
        except TimeoutError:
            raise TimeoutError(f"{what % args if args else what}: not ready after {self.poll.timeout_s:g} s") \
                from None
        return fut.result()
