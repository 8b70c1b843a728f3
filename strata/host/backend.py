"""The seam between the host scheduler and a device: per step of T tokens, per layer, `pre` then `post`.

A step is a flat list of T rows: runs (Segment) of consecutive tokens of one sequence each, a prompt chunk or
one decoding token, decode rows first by the scheduler's policy. Per step:

    begin(step, route_x=True)         stage the rows' token ids and positions, embed them; route_x=False: the
                                      step's routes will not carry the rows' x (a streamed step reads no x)
    stage_ple(e)                      the rows' gathered PLE vectors (T, ple_dim), any time before launch_pre of the
                                      PLE layer, so the host's row reads overlap layer 0
    launch_pre(l)                     start pre[l] for all T rows: [PLE] -> gr_read -> mixer -> gr_write -> gr_read
                                      -> route
    poll_route(l) -> Route|None       the doorbell: None until pre[l] has published the routes of all T rows;
                                      never blocks
    resident(l, experts) -> bool      which of these experts (U,) the backend computes itself (VRAM cache hits)
    expert_slots() -> int             how many experts fit the backend's expert cache (0: none)
    load_expert(l, e, slot, g, u, d)  copy expert e of layer l (its three raw weight slices) into a cache slot,
                                      replacing whatever the slot held; the host's cache policy picks the slot
    loads_done()                      optional: the copies load_expert queued go to the device now, as one batch
                                      (else the next post or mapped token sends them); the host calls it after a
                                      layer's uploads, before a wait for a blob's read, and after promotions
    stream_slots() -> int             optional: how many experts of one layer a step may stream (0: none); then
    stream_open(l)                    per layer of a step of several rows, in layer order: layer l's stream buffer
    stream_experts(l, items)          (two buffers, alternating by layer) takes experts copied while the layer
    stream_close(l)                   before computes, items (e, g, u, d, s) in order, in one call or several;
                                      opened once post[l - 2] (its buffer's last reader) is launched;
                                      launch_post(l) computes the streamed experts where its plan marks them
                                      resident (with the cache's), after the copies. s: a free cache slot the
                                      host's policy picked (or None): the copy goes there and the expert stays
                                      resident, ordered like the stream's other copies
    lent_slots() -> int               optional: the last n of expert_slots() are the stream buffers and the
    take_lent(stream, rows) -> ids    batched step's activations, which the cache holds between steps of several
    return_lent()                     rows: such a step takes back first the slots it writes (the activations'
                                      its rows touch, and the stream buffers' when it streams; their ids
                                      returned), their experts leave the cache, and it returns them once its
                                      logits are in; load_expert puts nothing in them meanwhile
    launch_post_streamed(l)           optional, with streaming: post[l] of a streamed step once its copies are
                                      enqueued, without the host reading l's route; pre[l + 1] may follow at once
    post_done(l) -> bool              a streamed step's post[l] has run (never blocks): the host keeps its launches
                                      a few layers ahead of the device, no further
    streamed_routes()                 after a streamed step's head: each layer's routed experts (n_layer, T, k)
    stream_times()                    after a streamed step: [(layer, experts, bytes, copy_ms, exposed_ms, pre_ms,
                                      post_ms, idle_ms)], the device's copy time per layer, how much of it post[l]
                                      waited for, pre[l]'s and post[l]'s device time, the device's idle gap before
                                      pre[l]
    launch_post(plan)                 start post[plan.layer] with the host's expert outputs (ExpertPlan); the next
                                      launch (pre[l+1] or the head) follows it on the device in order, so the host
                                      never waits for a post: the next doorbell says it is done
    launch_head() / poll_logits()     the final mixer and LM head, for step.logit_rows only: (L, n_vocab)
    max_seqs                          how many sequences may be live at once (None: no limit)
    max_step_tokens                   the most rows a step may carry (None: no limit but the scheduler's budget)
    in_flight() -> Future|None        optional: the stage in flight as a concurrent Future, for a device that is a
                                      thread of this process; the scheduler then awaits its end instead of polling
    launch_whole(step, e)             optional, with `experts == "vram"`: the whole step as one device job with no
                                      host round trip (every expert resident); then poll_logits
    snapshot(seq) -> (snap, nbytes)   optional: a copy of a sequence's state between steps (prefix reuse)
    restore(snap) -> seq              optional: a new live sequence holding a copy of that state

The scheduler never touches device memory and never blocks on the device: it polls. A backend raises
`BackendError` from any call once the device has failed; the scheduler turns it into an error on every open
stream. `CpuBackend` runs the numpy reference stages on one worker thread, with a future as the doorbell.
What strata.host.scheduler relies on: every call comes from one thread (its event loop's); a Route's arrays are
read before launch_post of the same layer; a plan's parts are a fresh array per launch_post, never touched again
by the host; load_expert's wall time plus the blob's bytes at h2d_bytes_per_s (a backend attribute, optional) is
what the host's cost model counts as an upload; a step whose stages did
not all run (the host failed between them) leaves its sequences unusable: the scheduler frees them.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from strata.config import ModelConfig
from strata.host.experts import ExpertLayout, compute_experts
from strata.quant.experts import max_threads
from strata.model.loader import Model
from strata.reference.gdn import GdnState
from strata.reference.model import Batch, PreOut, RefModel, SeqState, StageDump
from strata.reference.moe import group_by_expert
from strata.reference.ple import NgramWindow, PleState
from strata.reference.qsa import QsaState

# How a mapped token's kernels get the experts it misses in VRAM (the CUDA backend's mapped_reads, HostConfig's):
# fetched into VRAM staging first ("fetch"), the same with the next layer's predicted misses fetched a layer early
# ("prefetch"), or read over PCIe by the expert kernels themselves ("direct")
MAPPED_READS = ("fetch", "prefetch", "direct")
PREFETCH_EXTRA_MAX = 16     # experts a "prefetch" prediction may keep beyond the model's top k


class BackendError(RuntimeError):
    """The device failed or stopped answering; the message says which call and why."""


class BudgetTooSmall(BackendError):
    """A backend's memory does not fit its budget or the device (raised before anything is allocated)."""


@dataclass(frozen=True)
class Segment:
    """A run of one sequence's consecutive tokens in a step."""
    seq: object                     # the backend's sequence handle
    tokens: tuple[int, ...]
    pos: int                        # position of tokens[0]: how many tokens the sequence was fed before
    logits: str = "last"            # which of its rows need logits: "last", "all" (scoring) or "none"


@dataclass(frozen=True)
class Step:
    """T rows: the segments' tokens in order. logit_rows: the step rows whose logits the head produces."""
    segments: tuple[Segment, ...]
    tokens: np.ndarray = field(init=False)          # (T,) int64
    pos: np.ndarray = field(init=False)             # (T,) int64
    starts: np.ndarray = field(init=False)          # (S+1,) segment s is rows starts[s]:starts[s+1]
    logit_rows: np.ndarray = field(init=False)      # (L,) int64, ascending

    def __post_init__(self):
        if not self.segments or any(len(s.tokens) == 0 for s in self.segments):
            raise ValueError("a step needs segments of at least one token each")
        n = [len(s.tokens) for s in self.segments]
        starts = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
        rows = []
        for s, a, b in zip(self.segments, starts[:-1], starts[1:]):
            rows += {"last": [b - 1], "all": list(range(a, b)), "none": []}[s.logits]
        set_ = object.__setattr__
        set_(self, "tokens", np.array([t for s in self.segments for t in s.tokens], np.int64))
        set_(self, "pos", np.concatenate([np.arange(s.pos, s.pos + len(s.tokens)) for s in self.segments]))
        set_(self, "starts", starts)
        set_(self, "logit_rows", np.array(rows, np.int64))

    @property
    def T(self) -> int:
        return len(self.tokens)


@dataclass
class Route:
    """What pre[l] publishes at the doorbell, for every row of the step."""
    x: np.ndarray | None   # (T, E) float32: the MoE inputs (None: a streamed layer's, whose post needs none)
    ids: np.ndarray        # (T, k) int32: routed experts, in descending probability
    weights: np.ndarray    # (T, k) float32: their renormalized weights


@dataclass
class ExpertPlan:
    """Layer `layer`'s routed experts for a whole step, grouped by expert: experts[u] serves the flat (row * k + j)
    pairs[offsets[u]:offsets[u+1]]; resident[u]: the backend computes it (a VRAM hit); the host's outputs for every
    other pair are in parts."""
    layer: int
    experts: np.ndarray    # (U,) int32 ascending
    offsets: np.ndarray    # (U+1,) int64
    pairs: np.ndarray      # (T*k,) int64
    resident: np.ndarray   # (U,) bool
    parts: np.ndarray      # (T, k, E) float32: rows of resident pairs unused

    @classmethod
    def of(cls, layer: int, ids: np.ndarray, n_embd: int) -> "ExpertPlan":
        experts, offsets, pairs = group_by_expert(ids)
        return cls(layer, experts, offsets, pairs, np.zeros(len(experts), bool),
                   np.zeros((*ids.shape, n_embd), np.float32))

    @property
    def mask(self) -> np.ndarray:
        """(T, k) bool: which (row, j) the backend computes."""
        T, k = self.parts.shape[:2]
        m = np.empty(T * k, bool)
        m[self.pairs] = np.repeat(self.resident, np.diff(self.offsets))
        return m.reshape(T, k)


class Backend(Protocol):
    cfg: ModelConfig
    name: str
    max_seqs: int | None
    max_step_tokens: int | None

    def new_seq(self, dump: StageDump | None = None) -> object: ...
    def free_seq(self, seq: object) -> None: ...
    def begin(self, step: Step, route_x: bool = True) -> None: ...
    def stage_ple(self, e: np.ndarray) -> None: ...
    def launch_pre(self, layer: int) -> None: ...
    def poll_route(self, layer: int) -> Route | None: ...
    def resident(self, layer: int, experts: np.ndarray) -> np.ndarray: ...
    def expert_slots(self) -> int: ...
    def load_expert(self, layer: int, expert: int, slot: int, gate: np.ndarray, up: np.ndarray,
                    down: np.ndarray) -> None: ...
    def launch_post(self, plan: ExpertPlan) -> None: ...
    def launch_head(self) -> None: ...
    def poll_logits(self) -> np.ndarray | None: ...
    def close(self) -> None: ...


@dataclass
class _CpuSeq:
    st: SeqState | None


def _copy_state(st: SeqState) -> SeqState:
    """A deep copy of a sequence's state (no dump: a snapshot records nothing)."""
    return SeqState(
        st.pos,
        {il: GdnState(g.conv.copy(), g.S.copy()) for il, g in st.gdn.items()},
        {il: QsaState(*(r.copy() for r in (q.k, q.v, q.idx_raw, q.idx_blocks))) for il, q in st.qsa.items()},
        None if st.ple is None else PleState(st.ple.hist.copy()),
        None if st.window is None else NgramWindow(st.window.prev))


def _state_bytes(st: SeqState) -> int:
    return (sum(g.conv.nbytes + g.S.nbytes for g in st.gdn.values())
            + sum(r.a.nbytes for q in st.qsa.values() for r in (q.k, q.v, q.idx_raw, q.idx_blocks))
            + (0 if st.ple is None else st.ple.hist.nbytes))


class _Copy:
    """A streamed expert's three slices, copied (the CPU twin of a stream buffer's slot) with their addresses."""

    def __init__(self, gate: np.ndarray, up: np.ndarray, down: np.ndarray):
        self.gate, self.up, self.down = (np.array(v, copy=True, order="C") for v in (gate, up, down))
        self.addr = tuple(v.__array_interface__["data"][0] for v in (self.gate, self.up, self.down))
        self.nbytes = self.gate.nbytes + self.up.nbytes + self.down.nbytes


class CpuBackend:
    """The numpy reference as a device: its stages run in launch order on one worker thread (a stream); the future
    of a stage is its doorbell.

    experts="host": no expert is resident: every routed expert is the host's work (the scheduler's CPU pool over its
    expert store), the CPU twin of an empty VRAM cache. With stream=True a step of several rows may also stream
    them (stream_open .. stream_close): the CPU twin of CudaBackend's stream buffers, copies of the blobs kept per
    layer parity that post computes with the CPU pool's compiled batch, the double buffer's protocol checked. The
    engine leaves it off on the CPU: the pool computes the same experts without the copies, and a chunk whose rows
    reach every expert several times would stream without a trial of the split (Scheduler._streams).
    cache_slots > 0 (experts="host"): the CPU twin of CudaBackend's VRAM expert cache: load_expert copies a blob
    into a slot (evicting the slot's expert), resident() reports the slots, post computes the resident routed
    experts from their slot copies. With map_experts (every blob held by the host) a one-row step may run as a
    mapped token (launch_whole): each routed expert read from its slot, or from its blob where it has none, and a
    slot loaded since the previous launch still counts as the host's (its copy is in flight on the GPU) until
    the launch after it; token_routes() says which each token read from where. batch_slots: the twin of
    CudaBackend's batched-step activations lent to the cache (lent_slots), that many slots more, of which a step of
    several rows takes back one a row (as a CUDA step takes back those its rows touch).
    experts="mapped": every expert is resident: post computes
    the layer's routed experts itself from the mapped file, in one compiled batch (the CPU twin of
    CudaBackend(experts="vram")), so a layer's experts cost no host work and no hand-off to the pool.
    """

    name = "cpu"
    max_seqs = None
    max_step_tokens = None

    def __init__(self, model: Model, experts: str = "host", stream: bool = False, cache_slots: int = 0,
                 batch_slots: int = 0):
        if experts not in ("host", "mapped"):
            raise ValueError(f"CpuBackend experts={experts!r}: choose 'host' or 'mapped'")
        if cache_slots and experts != "host":
            raise ValueError("CpuBackend cache_slots: the cache twin is for experts='host'")
        self.experts = experts
        self.cfg = model.cfg
        self.ref = RefModel(model.weights)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="strata-cpu-device")
        self.live = 0                    # sequences between new_seq and free_seq: what a leak check counts
        self.step: Step | None = None
        self.batch: Batch | None = None
        self.R: np.ndarray | None = None          # (T, hc, E) the streams between stages (the worker's, as are
                                                  # pre and failed)
        self.ple_e: np.ndarray | None = None
        self.pre: PreOut | None = None            # the last pre's output (the worker's)
        self.layer = -1                           # the layer launched last
        self.routed = -1                          # the layer whose route the host has
        self.job: Future | None = None            # the stage launched last
        self._pre_job: Future | None = None       # the last pre (poll_route's: a streamed post may follow it)
        self._wb: Batch | None = None             # the worker's step and batch (set by its begin stage)
        self._wstep: Step | None = None
        self.failed: BaseException | None = None  # a stage that raised: the step's later stages do not run
        self.layout = ExpertLayout.from_model(model)
        lw = model.weights.layers[0]
        self.exact = bool(getattr(lw.ffn_down_exps, "exact", False))
        self.stream = stream and experts == "host"
        self.posted = -1                          # the layer whose post was launched last
        self._stream: dict[int, list] = {}        # parity -> [layer, {expert: (gate, up, down) copies}, open]
        self._stream_log: list[tuple] = []
        # the cache twin: slot -> copy, the (layer, expert) -> slot map, the launch count of each slot's load
        self.n_slots = int(cache_slots)
        # the stream buffers' twin (two layers' experts), lent to the cache between streamed steps (lent_slots)
        unheld = self.cfg.n_layer * self.cfg.n_expert - self.n_slots
        self.n_lend = max(0, min(2 * self.cfg.n_expert, unheld)) if self.stream and self.n_slots else 0
        # then the batched step's activations' twin (batch_slots of them), which any step of several rows takes back
        self.n_lend_act = max(0, min(int(batch_slots), unheld - self.n_lend)) if self.n_slots else 0
        self.n_lend += self.n_lend_act
        self._taken: np.ndarray | None = None     # the lent slots a step of several rows took back (by slot)
        n_all = self.n_slots + self.n_lend
        self._slot_copy: list[_Copy | None] = [None] * n_all
        self._owner: list[tuple[int, int] | None] = [None] * n_all
        self._slots = np.full((self.cfg.n_layer, self.cfg.n_expert), -1, np.int32)
        self._loaded_at = np.full(max(n_all, 1), -1, np.int64)
        self.launches = 0                         # mapped tokens launched
        self.mapped = False
        self._blobs: list | None = None
        self._routes: tuple[np.ndarray, np.ndarray] | None = None

    def new_seq(self, dump: StageDump | None = None) -> _CpuSeq:
        self.live += 1
        return _CpuSeq(self.ref.new_state(dump))

    def free_seq(self, seq: _CpuSeq) -> None:
        if seq.st is not None:
            self.live -= 1
        seq.st = None

    def snapshot(self, seq: _CpuSeq) -> tuple[SeqState, int]:
        """A copy of seq's state (between steps: nothing of it is in flight) and its bytes."""
        if self.job is not None and not self.job.done():
            raise BackendError("snapshot: a stage is running")
        snap = _copy_state(seq.st)
        return snap, _state_bytes(snap)

    def restore(self, snap: SeqState) -> _CpuSeq:
        self.live += 1
        return _CpuSeq(_copy_state(snap))

    def begin(self, step: Step, route_x: bool = True) -> None:
        """Queued like every stage: a step the host gave up on (a read failed) may still have a post running.
        route_x: a route's x here is a view of the stage's own array (free), so it is given either way."""
        runs = []
        for s in step.segments:
            if s.seq.st is None:
                raise BackendError("begin: a segment's sequence was freed")
            if s.seq.st.pos != s.pos:
                raise BackendError(f"begin: a segment starts at position {s.pos}, its sequence is at {s.seq.st.pos}")
            runs.append((s.seq.st, s.tokens))
        self.step, self.batch, self.ple_e = step, Batch.of(runs), None
        self.layer = self.routed = self.posted = -1
        self._stream, self._stream_log = {}, []
        self._streamed_ids: dict[int, np.ndarray] = {}     # a streamed layer's routes, kept by its post
        self._post_jobs: dict[int, Future] = {}             # a streamed layer's post stage
        self._run(self._begin, self.batch, step, fresh=True)

    def _begin(self, batch: Batch, step: Step) -> None:
        # the worker's own step: stages of a step the host gave up on, still queued, finish with theirs (as a
        # device stream runs a failed step's kernels before the next step's)
        self._wb, self._wstep = batch, step
        self.pre, self.R = None, self.ref.embed(batch)

    def stage_ple(self, e: np.ndarray) -> None:
        if e.shape != (self.batch.T, self.cfg.ple_dim):
            raise BackendError(f"stage_ple: PLE vectors of shape {e.shape}, the step needs "
                               f"({self.batch.T}, {self.cfg.ple_dim})")
        self.ple_e = e

    def _run(self, fn, *args, fresh: bool = False) -> None:
        """Queue a stage behind the ones launched before it; a step's first (fresh) forgets an earlier failure."""
        def stage():
            if fresh:
                self.failed = None
            elif self.failed is not None:
                raise BackendError(f"an earlier stage of this step failed: {self.failed!r}")
            try:
                return fn(*args)
            except BaseException as e:
                self.failed = e
                raise
        self.job = self._worker.submit(stage)

    def in_flight(self) -> Future | None:
        return self.job

    def _result(self, job: Future | None = None):
        job = self.job if job is None else job
        if job is None or not job.done():
            return None
        try:
            return job.result()
        except Exception as e:       # a failing stage is a failing device
            raise BackendError(f"cpu stage failed: {e!r}") from e

    def _pre(self, layer: int, ple: np.ndarray | None) -> PreOut:
        self.pre = self.ref.pre(self._wb, layer, self.R, ple)
        return self.pre

    def _post(self, layer: int, parts: np.ndarray) -> None:
        self.R = self.ref.post(self._wb, layer, self.pre, parts)

    def _post_mapped(self, layer: int) -> None:
        self._post(layer, self.ref.experts(layer, self.pre.x, self.pre.ids))

    def launch_pre(self, layer: int) -> None:
        if layer != self.layer + 1 or layer != self.routed + 1:
            raise BackendError(f"launch_pre({layer}) after layer {self.layer}")
        ple = self.ple_e if layer in self.cfg.ple_layers else None
        if layer in self.cfg.ple_layers and ple is None:
            raise BackendError(f"pre[{layer}] launched before the step's PLE vectors were staged")
        self.layer = layer
        self._run(self._pre, layer, ple)
        self._pre_job = self.job

    def poll_route(self, layer: int) -> Route | None:
        if layer != self.layer:
            raise BackendError(f"poll_route({layer}): pre[{self.layer}] is the one launched")
        p = self._result(self._pre_job)
        if p is None:
            return None
        self.routed = layer
        return Route(p.x, p.ids, p.weights)

    def resident(self, layer: int, experts: np.ndarray) -> np.ndarray:
        if self.n_slots:
            return self._slots[layer, np.asarray(experts, np.int64)] >= 0
        return np.full(len(experts), self.experts == "mapped")

    def expert_slots(self) -> int:
        return self.n_slots + self.n_lend

    def lent_slots(self) -> int:
        return self.n_lend

    def take_lent(self, stream: bool, rows: int) -> np.ndarray:
        """A step of `rows` rows takes back the lent slots it writes (the activations' twin: one slot a row, up to
        batch_slots; the stream buffers' when it streams): their experts are no longer resident. Returns their
        ids."""
        n_str = self.n_lend - self.n_lend_act
        act = self.n_slots + n_str + np.arange(min(rows, self.n_lend_act))
        ids = np.concatenate([np.arange(self.n_slots, self.n_slots + n_str) if stream else act[:0], act])
        for slot in ids.tolist():
            old = self._owner[slot]
            if old is not None:
                self._slots[old] = -1
            self._owner[slot] = self._slot_copy[slot] = None
        self._taken = np.zeros(self.n_slots + self.n_lend, bool)
        self._taken[ids] = True
        return ids

    def return_lent(self) -> None:
        self._taken = None

    def load_expert(self, layer: int, expert: int, slot: int, gate: np.ndarray, up: np.ndarray,
                    down: np.ndarray) -> None:
        if not self.n_slots:
            raise BackendError("the cpu backend has no expert cache (cache_slots=0)")
        if not 0 <= slot < self.n_slots + self.n_lend:
            raise BackendError(f"load_expert: slot {slot} of {self.n_slots + self.n_lend}")
        if self._taken is not None and self._taken[slot]:
            raise BackendError(f"load_expert: slot {slot} is lent to the cache between batched steps and taken "
                               f"back by the step in flight")
        if not (0 <= layer < self.cfg.n_layer and 0 <= expert < self.cfg.n_expert):
            raise BackendError(f"load_expert: expert {expert} of layer {layer} does not exist")
        copy = _Copy(gate, up, down)
        old = self._owner[slot]
        if old is not None:
            self._slots[old] = -1
        self._owner[slot], self._slot_copy[slot] = (layer, expert), copy
        self._slots[layer, expert] = slot
        self._loaded_at[slot] = self.launches

    def map_experts(self, blobs) -> bool:
        """Every expert's blob (blobs[layer][expert], held by the host while mapped): mapped tokens from now on.
        Only the cache twin maps (False otherwise): without a cache a mapped token is experts="mapped"'s work."""
        cfg = self.cfg
        if self.experts != "host" or not self.n_slots:
            return False
        if len(blobs) != cfg.n_layer or any(len(b) != cfg.n_expert for b in blobs):
            raise BackendError(f"map_experts: blobs for {len(blobs)} layers; the model has {cfg.n_layer} layers of "
                               f"{cfg.n_expert} experts")
        self._blobs = [list(b) for b in blobs]
        self.mapped = True
        return True

    def launch_whole(self, step: Step, e: np.ndarray | None) -> None:
        """A mapped token: every layer on the worker, each routed expert from its slot copy if its load came before
        the previous launch (the GPU's copy is done by then), else from its mapped blob."""
        if not self.mapped or step.T != 1:
            raise BackendError("launch_whole: the cpu backend runs one-row mapped tokens only (map_experts first)")
        self.begin(step)
        if self.cfg.ple_layers:
            if e is None:
                raise BackendError("launch_whole: the model's PLE layer needs the row's PLE vector")
            self.stage_ple(np.asarray(e, np.float32).reshape(1, -1))
        s = self._slots
        eff = (s >= 0) & (self._loaded_at[np.maximum(s, 0)] < self.launches)
        self.launches += 1
        self.layer = self.routed = self.cfg.n_layer - 1
        self._routes = None
        # the slots as this launch sees them: a load made while it runs goes to the GPU's side stream after it
        self._run(self._token, self.ple_e, eff, s.copy(), list(self._slot_copy))

    def _token(self, ple: np.ndarray | None, eff: np.ndarray, slots: np.ndarray, copies: list) -> np.ndarray:
        cfg, k = self.cfg, self.cfg.n_expert_used
        ids_all = np.empty((cfg.n_layer, k), np.int32)
        for il in range(cfg.n_layer):
            self._pre(il, ple if il in cfg.ple_layers else None)
            ids = np.asarray(self.pre.ids[0], np.int64)
            ids_all[il] = ids
            src = [copies[slots[il, e]] if eff[il, e] else self._blobs[il][e] for e in ids.tolist()]
            out = np.empty((k, cfg.n_embd), np.float32)
            compute_experts(self.layout.layers[il], np.asarray(self.pre.x, np.float32), src,
                            np.arange(k + 1, dtype=np.int64), np.zeros(k, np.int64), out, list(range(k)),
                            self.exact, max_threads())
            self._post(il, out[None])
        self._routes = (ids_all, eff[np.arange(cfg.n_layer)[:, None], ids_all])
        logits = self.ref.head(self._wb, self.R, self._wstep.logit_rows.tolist())
        self.ref.finish(self._wb)
        return logits

    def token_routes(self) -> tuple[np.ndarray, np.ndarray]:
        """After a mapped token's logits: each layer's routed experts (n_layer, k), and which came from a slot."""
        if self._routes is None:
            raise BackendError("token_routes: no mapped token has finished")
        ids, res = self._routes
        return ids.copy(), res.copy()

    def stream_slots(self) -> int:
        return self.cfg.n_expert if self.stream else 0

    def stream_open(self, layer: int) -> None:
        if not self.stream_slots():
            raise BackendError("stream_open: this backend streams no experts (experts='host', stream=True does)")
        if self.step is None or self.step.T < 2:
            raise BackendError("stream_open: streaming is for a step of several rows")
        old = self._stream.get(layer % 2)
        if old is not None and (old[2] or old[0] >= layer):
            raise BackendError(f"stream_open({layer}): layer {old[0]}'s stream is {'open' if old[2] else 'newer'}")
        if layer >= 2 and self.posted < layer - 2:
            raise BackendError(f"stream_open({layer}): post[{layer - 2}], the last reader of its buffer, is not "
                               f"launched")
        self._stream[layer % 2] = [layer, {}, True]

    def stream_experts(self, layer: int, items) -> None:
        s = self._stream.get(layer % 2)
        if s is None or s[0] != layer or not s[2]:
            raise BackendError(f"stream_experts: layer {layer}'s stream is not open")
        for expert, gate, up, down, slot in items:
            if not 0 <= expert < self.cfg.n_expert or expert in s[1]:
                raise BackendError(f"stream_experts: expert {expert} of layer {layer} (out of range or streamed "
                                   f"twice)")
            if self.n_slots and self._slots[layer, expert] >= 0:
                raise BackendError(f"stream_experts: expert {expert} of layer {layer} is in the cache; a step "
                                   f"streams only what its layers lack")
            if slot is not None:                  # a free cache slot takes it (the same copy, as on the GPU)
                self.load_expert(layer, expert, slot, gate, up, down)
            else:
                s[1][expert] = _Copy(gate, up, down)

    def stream_close(self, layer: int) -> None:
        s = self._stream.get(layer % 2)
        if s is None or s[0] != layer or not s[2]:
            raise BackendError(f"stream_close: layer {layer}'s stream is not open")
        s[2] = False
        self._stream_log.append((layer, len(s[1]), sum(c.nbytes for c in s[1].values()), 0.0, 0.0, 0.0, 0.0, 0.0))

    def stream_times(self) -> list[tuple]:
        """(layer, experts, bytes, copy_ms, exposed_ms, pre_ms, post_ms, idle_ms): the copies are host memory
        copies made at once and the layers compute on the host (no device time to measure: 0)."""
        return list(self._stream_log)

    def check_plan(self, plan: ExpertPlan) -> None:
        """A plan must be for the layer whose route is out, and carry every row: the stale-expert guard."""
        if plan.layer != self.routed or self.routed != self.layer:
            raise BackendError(f"launch_post: a plan for layer {plan.layer}, the step is at layer {self.routed}")
        T, k = self.batch.T, self.cfg.n_expert_used
        if plan.parts.shape != (T, k, self.cfg.n_embd):
            raise BackendError(f"launch_post: parts of shape {plan.parts.shape} for a step of {T} rows x {k} "
                               f"experts")

    def launch_post(self, plan: ExpertPlan) -> None:
        self.check_plan(plan)
        if self.experts == "mapped":
            if not plan.resident.all():
                raise BackendError("launch_post: the plan leaves experts to the host; every one is resident here")
            self._run(self._post_mapped, plan.layer)
        elif plan.resident.any():
            s = self._stream.get(plan.layer % 2)
            if s is not None and s[0] == plan.layer:
                raise BackendError(f"launch_post: layer {plan.layer} streamed its experts in this step (its post is "
                                   f"launch_post_streamed)")
            res = plan.experts[plan.resident]
            lost = [int(e) for e in res if not self.n_slots or self._slots[plan.layer, e] < 0]
            if lost:
                raise BackendError(f"launch_post: experts {lost} of layer {plan.layer} are marked resident but "
                                   f"are in no cache slot")
            self._run(self._post_copies, plan, {int(e): self._slot_copy[self._slots[plan.layer, e]] for e in res})
        else:
            self._run(self._post, plan.layer, plan.parts)
        self.posted = plan.layer

    def launch_post_streamed(self, layer: int) -> None:
        """post[layer] of a streamed step without the host reading its route (CudaBackend's): every expert is in a
        cache slot or the layer's closed stream; the worker groups pre's routes itself and keeps them for
        streamed_routes. pre[layer + 1] may follow at once."""
        if layer != self.layer or self.routed != layer - 1:
            raise BackendError(f"launch_post_streamed({layer}): pre[{self.layer}] is the one launched, the route of "
                               f"layer {self.routed} the last read")
        s = self._stream.get(layer % 2)
        if s is None or s[0] != layer or s[2]:
            raise BackendError(f"launch_post_streamed: layer {layer} has no closed stream in this step")
        have = dict(s[1])
        for e in range(self.cfg.n_expert):
            slot = self._slots[layer, e] if self.n_slots else -1
            if e not in have and slot >= 0:
                have[e] = self._slot_copy[slot]
        lost = [e for e in range(self.cfg.n_expert) if e not in have]
        if lost:
            raise BackendError(f"launch_post_streamed: experts {lost[:8]} of layer {layer} are in no cache slot and "
                               f"were not streamed")

        def post():
            plan = ExpertPlan.of(layer, self.pre.ids, self.cfg.n_embd)
            plan.resident[:] = True
            self._post_copies(plan, have)
            self._streamed_ids[layer] = np.asarray(self.pre.ids, np.int32)
        self._run(post)
        self._post_jobs[layer] = self.job
        self.posted = self.routed = layer

    def post_done(self, layer: int) -> bool:
        """Whether post[layer] of the streamed step in flight has run (never blocks; a failed stage raises)."""
        job = self._post_jobs.get(layer)
        if job is None:
            raise BackendError(f"post_done({layer}): post[{layer}] of a streamed step is not launched")
        if not job.done():
            return False
        self._result(job)
        return True

    def streamed_routes(self) -> np.ndarray:
        """After a streamed step's head: every streamed layer's routed experts (n_layer, T, k) int32 (zeros for a
        layer that did not stream)."""
        if self.job is not None:                 # poll_logits clears it once the head's logits are out
            raise BackendError("streamed_routes: the step's logits have not been read")
        out = np.zeros((self.cfg.n_layer, self.batch.T, self.cfg.n_expert_used), np.int32)
        for layer, ids in self._streamed_ids.items():
            out[layer] = ids
        return out

    def _post_copies(self, plan: ExpertPlan, streamed: dict) -> None:
        """post with the resident experts' outputs computed here from their copies (cache slots or the layer's
        stream: streamed[expert]), over their rows, the CPU pool's way."""
        us = np.flatnonzero(plan.resident)
        o = plan.offsets
        sel = np.concatenate([plan.pairs[o[u]:o[u + 1]] for u in us])
        offsets = np.concatenate([[0], np.cumsum(o[us + 1] - o[us])]).astype(np.int64)
        out = np.empty((len(sel), self.cfg.n_embd), np.float32)
        compute_experts(self.layout.layers[plan.layer], np.asarray(self.pre.x, np.float32),
                        [streamed[int(plan.experts[u])] for u in us], offsets, sel // self.cfg.n_expert_used, out,
                        list(range(len(us))), self.exact, max_threads())
        parts = np.array(plan.parts, np.float32)
        parts.reshape(-1, self.cfg.n_embd)[sel] = out
        self._post(plan.layer, parts)

    def launch_head(self) -> None:
        def head():
            logits = self.ref.head(self._wb, self.R, self._wstep.logit_rows.tolist())
            self.ref.finish(self._wb)
            return logits
        if self.routed != self.cfg.n_layer - 1:
            raise BackendError(f"launch_head after layer {self.routed}")
        self.layer = self.cfg.n_layer
        self._run(head)

    def poll_logits(self) -> np.ndarray | None:
        out = self._result()
        if out is not None:
            self.job = None
            self.layer = self.routed = -1
        return out

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
