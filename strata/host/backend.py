"""The seam between the host scheduler and a device: per sequence, per layer, `pre` then `post`.

    begin(seq, token, ple_e)       stage the token id and its gathered PLE vector (the host hashes and reads the rows)
    stage_ple(seq, ple_e)          the PLE vector later than begin (which then takes None): any time before
                                      launch_pre of the PLE layer, so the row reads overlap layer 0
    launch_pre(seq, l)                start pre[l]: [PLE] -> gr_read -> mixer -> gr_write -> gr_read -> route
    poll_route(seq, l) -> Route|None  the doorbell: None until pre[l] has published the route; never blocks
    resident(l, ids) -> bool mask     which routed experts the backend computes itself (VRAM cache hits)
    expert_slots() -> int             how many experts fit the backend's expert cache (0: none)
    load_expert(l, e, slot, g, u, d)  copy expert e of layer l (its three raw weight slices) into a cache slot,
                                      replacing whatever the slot held; the host's cache policy picks the slot
    launch_post(seq, l, parts, mask)  start post[l] with the host's expert outputs for the rows where mask is False
    launch_head(seq) / poll_logits    the final mixer and LM head
    max_seqs                          how many sequences may be live at once (None: no limit); the scheduler
                                      queues requests beyond it
    in_flight(seq) -> Future|None     optional: the stage in flight as a concurrent Future, for a device that is a
                                      thread of this process; the scheduler then awaits its end instead of polling

The scheduler never touches device memory and never blocks on the device: it polls. A backend raises
`BackendError` from any call once the device has failed; the scheduler turns it into an error on every open
stream. `CpuBackend` runs the numpy reference stages on one worker thread, with a future as the doorbell.
What strata.host.scheduler relies on: every call comes from one thread (its event loop's); a Route's arrays are
read before launch_post of the same layer; `parts` is a fresh array per launch_post, never touched again by the
host; load_expert's wall time is what the host's cost model counts as an upload.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from strata.config import ModelConfig
from strata.model.loader import Model
from strata.reference.model import PreOut, RefModel, SeqState, StageDump


class BackendError(RuntimeError):
    """The device failed or stopped answering; the message says which call and why."""


@dataclass
class Route:
    """What pre[l] publishes at the doorbell."""
    x: np.ndarray          # (E,) float32: the MoE input
    ids: np.ndarray        # (k,) int32: routed experts, in descending probability
    weights: np.ndarray    # (k,) float32: their renormalized weights


class Backend(Protocol):
    cfg: ModelConfig
    name: str
    max_seqs: int | None

    def new_seq(self, dump: StageDump | None = None) -> object: ...
    def free_seq(self, seq: object) -> None: ...
    def begin(self, seq: object, token: int, ple_e: np.ndarray | None) -> None: ...
    def stage_ple(self, seq: object, ple_e: np.ndarray) -> None: ...
    def launch_pre(self, seq: object, layer: int) -> None: ...
    def poll_route(self, seq: object, layer: int) -> Route | None: ...
    def resident(self, layer: int, ids: np.ndarray) -> np.ndarray: ...
    def expert_slots(self) -> int: ...
    def load_expert(self, layer: int, expert: int, slot: int, gate: np.ndarray, up: np.ndarray,
                    down: np.ndarray) -> None: ...
    def launch_post(self, seq: object, layer: int, parts: np.ndarray, resident: np.ndarray) -> None: ...
    def post_done(self, seq: object, layer: int) -> bool: ...
    def launch_head(self, seq: object) -> None: ...
    def poll_logits(self, seq: object) -> np.ndarray | None: ...
    def close(self) -> None: ...


@dataclass
class _CpuSeq:
    st: SeqState
    R: np.ndarray | None = None
    token: int = -1
    ple_e: np.ndarray | None = None
    pre: PreOut | None = None
    job: Future | None = None        # the stage in flight on the worker thread


class CpuBackend:
    """The numpy reference as a device: each stage runs on one worker thread; the future is the doorbell.

    No expert is resident: every routed expert is the host's work, which is the CPU twin of an empty VRAM cache.
    """

    name = "cpu"
    max_seqs = None

    def __init__(self, model: Model):
        self.cfg = model.cfg
        self.ref = RefModel(model.weights)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="strata-cpu-device")
        self.live = 0                    # sequences between new_seq and free_seq: what a leak check counts

    def new_seq(self, dump: StageDump | None = None) -> _CpuSeq:
        self.live += 1
        return _CpuSeq(self.ref.new_state(dump))

    def free_seq(self, seq: _CpuSeq) -> None:
        if seq.st is not None:
            self.live -= 1
        seq.st = seq.R = seq.pre = seq.job = None

    def begin(self, seq: _CpuSeq, token: int, ple_e: np.ndarray | None) -> None:
        seq.token, seq.ple_e = token, ple_e
        seq.R = self.ref.embed(seq.st, token)

    def stage_ple(self, seq: _CpuSeq, ple_e: np.ndarray) -> None:
        seq.ple_e = ple_e

    def _run(self, seq: _CpuSeq, fn, *args) -> None:
        if seq.job is not None and not seq.job.done():
            raise BackendError("a stage was launched while the previous one is still running")
        seq.job = self._worker.submit(fn, *args)

    def in_flight(self, seq: _CpuSeq) -> Future | None:
        return seq.job

    def _result(self, seq: _CpuSeq):
        if seq.job is None or not seq.job.done():
            return None
        try:
            return seq.job.result()
        except Exception as e:       # a failing stage is a failing device
            raise BackendError(f"cpu stage failed: {e!r}") from e

    def launch_pre(self, seq: _CpuSeq, layer: int) -> None:
        ple = seq.ple_e if layer in self.cfg.ple_layers else None
        if layer in self.cfg.ple_layers and ple is None:
            raise BackendError(f"pre[{layer}] launched before the token's PLE vector was staged")
        self._run(seq, self.ref.pre, seq.st, layer, seq.R, ple)

    def poll_route(self, seq: _CpuSeq, layer: int) -> Route | None:
        p = self._result(seq)
        if p is None:
            return None
        seq.pre, seq.job = p, None
        return Route(p.x, p.ids, p.weights)

    def resident(self, layer: int, ids: np.ndarray) -> np.ndarray:
        return np.zeros(len(ids), bool)

    def expert_slots(self) -> int:
        return 0

    def load_expert(self, layer: int, expert: int, slot: int, gate: np.ndarray, up: np.ndarray,
                    down: np.ndarray) -> None:
        raise BackendError("the cpu backend has no expert cache")

    def launch_post(self, seq: _CpuSeq, layer: int, parts: np.ndarray, resident: np.ndarray) -> None:
        if resident.any():
            raise BackendError("the cpu backend holds no experts")
        self._run(seq, self.ref.post, seq.st, layer, seq.pre, parts)

    def post_done(self, seq: _CpuSeq, layer: int) -> bool:
        R = self._result(seq)
        if R is None:
            return False
        seq.R, seq.job = R, None
        return True

    def launch_head(self, seq: _CpuSeq) -> None:
        def head():
            logits = self.ref.head(seq.st, seq.R)
            self.ref.finish_token(seq.st, seq.token)
            return logits
        self._run(seq, head)

    def poll_logits(self, seq: _CpuSeq) -> np.ndarray | None:
        out = self._result(seq)
        if out is not None:
            seq.job = None
        return out

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
