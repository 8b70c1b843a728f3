"""Latency traces of the step loop: one structlog JSON line per step, and the table `cli.py trace` prints.

A step record partitions the driver's timeline. The driver awaits one thing at a time, so its spans (the pre and
post graphs, the doorbell, the waits for I/O, the CPU pool and uploads, sampling) never overlap, and the table's
residual 'other/host' makes the parts sum to the step's wall time exactly. I/O reads and CPU-pool batches run
in threads beside the driver; their intervals are listed separately and the summary measures how much of them
overlapped a device interval (hidden work). Times are ms since the process's trace origin, rounded to 1 us.
A step's events reach the requests' streams, and its record is written, in the next step's "tail" span: after
that step's first launch, while the device computes (at once when no step follows or a request ends).
A step carries T rows: prompt chunks and decoding tokens of any number of requests; its kind is "prefill" (prompt
rows only), "decode" (decode rows only) or "mixed".

    {"event": "step", "step": 7, "kind": "prefill" | "decode" | "mixed", "T": 96, "prompt_tokens": 64,
     "decode_tokens": 32, "rows": [[req, "prompt" | "decode", n_tokens, first_pos], ...], "t0": ms, "t1": ms,
     "spans":   [[kind, layer, t0, t1], ...],                          # the driver, in order; layer -1: none
     "io":      [[kind ("ple" | "expert"), bytes, t0, t1], ...],       # reads from the file (bytes the disk moved:
                                                                       # aligned spans with O_DIRECT), measured in
                                                                       # the I/O threads
     "cpu":     [[layer, n_experts, weight_bytes, t0, t1], ...],       # CPU-pool batches, first start to last end
     "experts": [[layer, routed, hits, cpu, fetched, cpu_bytes, fetched_bytes, ram, ssd], ...],
                                                                       # routed: (row, expert) pairs; the rest are
                                                                       # distinct experts: hits in VRAM (the
                                                                       # backend's), misses to the CPU pool or
                                                                       # uploaded; misses from the RAM tier or SSD
     "ple":     [rows, cache_hits],                                    # PLE table rows read, of them from RAM
     "prefetch": [started, misses, predicted, bytes],                  # reads the prefetch started (HostConfig.
                                                                       # prefetch) or experts a mapped token
                                                                       # fetched a layer early (mapped_reads
                                                                       # "prefetch"), the VRAM misses, of them
                                                                       # the ones predicted, the bytes started
     "experts_mode": "split" | "stream" | "mapped",                    # split: each layer's misses between the
                                                                       # CPU pool and uploads; stream: every
                                                                       # expert a layer lacks in VRAM copied in
                                                                       # while the layer before computes; mapped:
                                                                       # one graph, misses read by the kernels
                                                                       # from pinned host memory
     "mapped":  [experts, bytes],                                      # mapped steps: the misses read in place
     "mapped_dev": [table_ms, graph_ms, promoted, promoted_bytes,      # mapped steps on CUDA: the device's time
                    promote_ms],                                       # of the address table's copy and of the
                                                                       # graph; the newest promotions measured
                                                                       # (copies of earlier tokens' misses, run
                                                                       # beside this token; 0s when none ended)
     "stream":  [[layer, experts, bytes, copy_ms, exposed_ms,          # stream steps: the device's copy time per
                  pre_ms, post_ms, idle_ms, enqueue_ms], ...],         # layer, of it what post[l] waited for, the
                                                                       # layer's compute and the idle gap before
                                                                       # it; the host's time inside the backend's
                                                                       # calls enqueueing the layer's copies
     "tiers":   {"vram", "ram", "ssd": distinct experts, "ssd_bytes", "ssd_ms": reads in flight,
                 "ssd_hidden_ms": of it behind device, CPU pool or upload work, "ssd_exposed_ms": of it while the
                 driver only waited},
     "gc":      [[generation, t0, t1], ...],                           # Python's cyclic collector inside the step:
                                                                       # it stops every thread, so its pauses lie
                                                                       # inside the spans above (and delay them)
     "peak_rss": bytes}                                                # the process's high-water mark so far
"""

from __future__ import annotations

import atexit
import gc
import io
import json
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from strata.host.direct_io import peak_rss_bytes

_ORIGIN = time.perf_counter()

# span kinds: what the driver was doing, in the table's order; DEVICE spans are device intervals as the host saw
# them (launch call -> completion seen), WAITS are host waits on I/O, the CPU pool or PCIe uploads
DEVICE = ("pre_launch", "tail", "doorbell", "lag_wait", "post_launch", "head_launch", "head_wait", "token_launch",
          "promote", "token_wait")
WAITS = ("ple_wait", "io_wait", "cpu_wait", "upload", "stream_wait")
HOST = ("sample", "finish")
KINDS = ("ple_wait", "pre_launch", "doorbell", "lag_wait", "io_wait", "cpu_wait", "upload", "stream_wait",
         "post_launch", "head_launch", "head_wait", "token_launch", "promote", "tail", "token_wait", "sample", "finish")
LABELS = {
    "ple_wait": "PLE rows: read wait", "pre_launch": "pre graph: launch",
    "tail": "tail: last step's events",
    "doorbell": "post[l-1] + pre[l]: doorbell wait",
    "lag_wait": "streamed: post[l-2] wait (pre[l] next)",
    "io_wait": "experts: read wait", "cpu_wait": "experts: CPU pool wait", "upload": "experts: upload (PCIe)",
    "stream_wait": "experts: stream's reads wait",
    "post_launch": "post graph: launch", "head_launch": "head: launch",
    "head_wait": "post[last] + head: wait", "token_launch": "whole-token graph: launch",
    "promote": "graph running: cache promotions",
    "token_wait": "whole-token graph: wait", "sample": "sample (delivered in the tail)",
    "finish": "requests finishing (prefix kept)", "other": "other/host (residual)",
}


def clock() -> float:
    """Seconds on the trace clock (perf_counter, shared by every thread)."""
    return time.perf_counter()


# The collector's pauses (generation, start, end; trace clock), appended by its callback in whatever thread
# allocated. A full collection walks every tracked object: in a streamed prefill chunk on the H200's host two
# waits of 88 and 112 ms that were gone with the collector off (bench/RESULTS.md 2026-12-03), which is why
# Engine freezes what it loaded.
_GC: deque = deque(maxlen=4096)
_GC_START = [0.0]


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _GC_START[0] = time.perf_counter()
    else:
        _GC.append((info["generation"], _GC_START[0], time.perf_counter()))


def watch_gc() -> None:
    """Record the cyclic collector's pauses from now on (once per process)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def gc_pauses(t0: float, t1: float) -> list[tuple[int, float, float]]:
    """The recorded collections that began in [t0, t1], oldest first."""
    out = []
    for g, a, b in reversed(tuple(_GC)):            # a copy: the callback may append while this runs
        if a < t0:
            break
        if a <= t1:
            out.append((g, a, b))
    return out[::-1]


_PEAK = [0]


def _peak_rss(step: int, kind: str) -> int:
    """The process's peak RSS for a step's record: read afresh for every step that is not a decode row and every
    16th step (/proc/self/status costs 0.1-0.2 ms, a decode token's host work is ~1 ms, and one token's rows move
    the peak by kilobytes)."""
    if kind != "decode" or step % 16 == 0 or not _PEAK[0]:
        _PEAK[0] = peak_rss_bytes()
    return _PEAK[0]


def _ms(t: float) -> float:
    return round((t - _ORIGIN) * 1e3, 3)


@dataclass
class StepTrace:
    """What one step did; filled by the driver, emitted when the step ends."""
    step: int
    rows: list                  # [req, "prompt" | "decode", n_tokens, first_pos] per segment
    t0: float
    t1: float = 0.0
    # clock seconds while the step runs (the hot path appends only); ms when recorded
    spans: list = field(default_factory=list)     # (kind, layer, t0, t1)
    io: list = field(default_factory=list)        # (kind, bytes, t0, t1)
    cpu: list = field(default_factory=list)       # (layer, n, bytes, t0, t1)
    experts: list = field(default_factory=list)   # (layer, routed, hits, cpu, fetched, cpu_bytes, fetched_bytes,
                                                  #  ram, ssd)
    ple: list = field(default_factory=lambda: [0, 0])     # [rows, cache hits]
    prefetch: list = field(default_factory=lambda: [0, 0, 0, 0])  # [started, misses, misses predicted, bytes]
    mode: str = "split"                           # how the layers' misses were served: "split" or "stream"
    stream: list = field(default_factory=list)    # (layer, experts, bytes, copy, exposed, pre, post, idle ms)
    mapped: list = field(default_factory=lambda: [0, 0])  # mapped steps: [VRAM misses read in place, their bytes]
    mapped_dev: list | None = None                # [table_ms, graph_ms, promoted, promoted_bytes, promote_ms]

    @property
    def prompt_tokens(self) -> int:
        return sum(r[2] for r in self.rows if r[1] == "prompt")

    @property
    def decode_tokens(self) -> int:
        return sum(r[2] for r in self.rows if r[1] == "decode")

    @property
    def kind(self) -> str:
        p, d = self.prompt_tokens, self.decode_tokens
        return "mixed" if p and d else "prefill" if p else "decode"

    def span(self, kind: str, layer: int, t0: float, t1: float) -> None:
        self.spans.append((kind, layer, t0, t1))

    def read(self, kind: str, nbytes: int, t0: float, t1: float) -> None:
        self.io.append((kind, nbytes, t0, t1))

    def cpu_batch(self, layer: int, n: int, nbytes: int, t0: float, t1: float) -> None:
        self.cpu.append((layer, n, nbytes, t0, t1))

    def layer_experts(self, layer: int, routed: int, hits: int, cpu: int, fetched: int, cpu_bytes: int,
                      fetched_bytes: int, ram: int = 0, ssd: int = 0) -> None:
        self.experts.append((layer, routed, hits, cpu, fetched, cpu_bytes, fetched_bytes, ram, ssd))

    def mapped_read(self, n: int, nbytes: int) -> None:
        self.mapped[0] += n
        self.mapped[1] += nbytes

    def mapped_device(self, table_ms: float, graph_ms: float, promoted: tuple | None) -> None:
        n, nbytes, ms = promoted or (0, 0, 0.0)
        self.mapped_dev = [round(table_ms, 4), round(graph_ms, 4), int(n), int(nbytes), round(ms, 4)]

    def prefetch_issued(self, n: int, nbytes: int = 0) -> None:
        self.prefetch[0] += n
        self.prefetch[3] += nbytes

    def prefetch_used(self, misses: int, predicted: int) -> None:
        self.prefetch[1] += misses
        self.prefetch[2] += predicted

    def ple_rows(self, rows: int, hits: int) -> None:
        self.ple[0] += rows
        self.ple[1] += hits

    def by_kind(self) -> dict[str, float]:
        """Seconds per span kind."""
        out: dict[str, float] = defaultdict(float)
        for kind, _, t0, t1 in self.spans:
            out[kind] += t1 - t0
        return out

    def record(self) -> dict:
        return {"step": self.step, "kind": self.kind, "T": self.prompt_tokens + self.decode_tokens,
                "prompt_tokens": self.prompt_tokens, "decode_tokens": self.decode_tokens,
                "rows": [list(r) for r in self.rows], "t0": _ms(self.t0), "t1": _ms(self.t1),
                "spans": [[k, l, _ms(a), _ms(b)] for k, l, a, b in self.spans],
                "io": [[k, n, _ms(a), _ms(b)] for k, n, a, b in self.io],
                "cpu": [[l, n, b, _ms(t0), _ms(t1)] for l, n, b, t0, t1 in self.cpu],
                "experts": [list(e) for e in self.experts], "ple": list(self.ple), "tiers": self.tiers(),
                "prefetch": list(self.prefetch), "experts_mode": self.mode,
                "stream": [[l, n, b, *(round(v, 3) for v in ms)] for l, n, b, *ms in self.stream],
                "mapped": list(self.mapped),
                **({"mapped_dev": list(self.mapped_dev)} if self.mapped_dev is not None else {}),
                "gc": [[g, _ms(a), _ms(b)] for g, a, b in gc_pauses(self.t0, self.t1)],
                "peak_rss": _peak_rss(self.step, self.kind)}

    def tiers(self) -> dict:
        """Where this step's distinct experts came from, and its reads from the file: bytes, time in flight, and
        how much of that was hidden behind device, CPU-pool or upload work or exposed (the driver only waited)."""
        io = union((a, b) for _, _, a, b in self.io)
        hidden, _, exposed = split_io(io, busy_intervals(self.spans, self.cpu_iv()), wait_intervals(self.spans))
        return {"vram": sum(e[2] for e in self.experts), "ram": sum(e[7] for e in self.experts),
                "ssd": sum(e[8] for e in self.experts), "ssd_bytes": sum(x[1] for x in self.io),
                "ssd_ms": round(1e3 * sum(b - a for a, b in io), 3), "ssd_hidden_ms": round(1e3 * hidden, 3),
                "ssd_exposed_ms": round(1e3 * exposed, 3)}

    def cpu_iv(self) -> list[tuple[float, float]]:
        return [(t0, t1) for *_, t0, t1 in self.cpu]


class Tracer:
    """Writes step records as JSON lines through structlog when given a file; otherwise records nothing.

    A record is built and written by a writer thread, not the event loop's: a decode step's record (48 layers'
    expert counts, the spans, the tiers' interval arithmetic, the JSON) took 0.3-0.6 ms, host time between two
    tokens. The StepTrace handed to emit is the step's own and is not touched again by the scheduler. flush()
    returns once everything emitted so far is in the file; close() flushes and ends the thread."""

    def __init__(self, path: str | None = None):
        self.path = path
        if path:
            watch_gc()
        self._file: io.TextIOBase | None = open(path, "w", encoding="utf-8") if path else None
        self._log = (structlog.wrap_logger(structlog.WriteLogger(self._file),
                                           processors=[structlog.processors.JSONRenderer()])
                     if self._file else None)
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None      # the writer's failure (a full disk): emit raises it
        if self._log is not None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._write, name="strata-trace", daemon=True)
            self._thread.start()
            atexit.register(self.flush)          # a process that never closed its engine still gets every record

    def _write(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            if self.error is not None:
                continue
            try:
                if isinstance(item, StepTrace):
                    self._log.info("step", **item.record())
                else:
                    self._log.info(item[0], **item[1])
            except Exception as e:               # reported by the next emit, on the loop's thread
                self.error = e

    def _put(self, item) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            raise OSError(f"the trace file {self.path} could not be written: {e}") from e
        self._queue.put(item)

    def emit(self, step: StepTrace) -> None:
        if self._queue is not None:
            self._put(step)

    def prefix(self, req: int, reused: int, prompt: int) -> None:
        """A request resumed from a snapshot: `reused` of its `prompt` tokens were not computed again."""
        if self._queue is not None:
            self._put(("prefix", {"req": req, "reused": reused, "prompt": prompt}))

    def flush(self) -> None:
        """Wait until every record emitted so far is written (a reader of the file mid-run calls this first)."""
        if self._queue is not None and self._thread.is_alive():
            done = threading.Event()
            self._queue.put(done)
            done.wait()

    def close(self) -> None:
        if self._file is not None:
            atexit.unregister(self.flush)
            if self._thread.is_alive():
                self._queue.put(None)
                self._thread.join()
            self._file.close()
            self._file = self._log = self._queue = None


# ---- the summary ------------------------------------------------------------------------------------------------

def load(path: str, event: str = "step") -> list[dict]:
    """The records of one event of a trace file ("step", or "prefix"); ValueError naming the line when broken."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e.msg})") from None
            if rec.get("event") == event:
                out.append(rec)
    return out


def union(ivs: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted disjoint intervals covering the same time as `ivs`."""
    out: list[list[float]] = []
    for a, b in sorted(ivs):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two unions (each sorted and disjoint)."""
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        tot += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of union a not in union b (each sorted and disjoint)."""
    out, j = [], 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k = j
        while lo < hi:
            if k >= len(b) or b[k][0] >= hi:
                out.append((lo, hi))
                break
            if b[k][0] > lo:
                out.append((lo, b[k][0]))
            lo = max(lo, b[k][1])
            k += 1
    return out


def busy_intervals(spans, cpu) -> list[tuple[float, float]]:
    """What a read can hide behind: device intervals, CPU-pool batches and uploads (spans: (kind, layer, t0, t1))."""
    return union([(s[2], s[3]) for s in spans if s[0] in DEVICE or s[0] == "upload"] + list(cpu))


def wait_intervals(spans) -> list[tuple[float, float]]:
    return union((s[2], s[3]) for s in spans if s[0] in WAITS and s[0] != "upload")


def split_io(io, busy, waits) -> tuple[float, float, float]:
    """Read time in flight (union io) split three ways that sum to it: behind busy work, behind host work, and
    exposed (nothing busy, the driver waiting)."""
    rest = subtract(io, busy)
    hidden = sum(b - a for a, b in io) - sum(b - a for a, b in rest)
    exposed = overlap(rest, waits)
    return hidden, sum(b - a for a, b in rest) - exposed, exposed


@dataclass
class PhaseSummary:
    phase: str                    # the step kind: prefill | decode | mixed
    steps: int
    tokens: int                   # rows fed (prompt + decode)
    prompt_tokens: int
    decode_tokens: int
    wall_ms: float                # the steps' wall time, summed
    ms: dict[str, float]          # mean ms per step by span kind, plus "other" and "total"
    device_ms: float              # per step, like the rest below
    wait_ms: float
    host_ms: float                # total - device - waits: the Python host overhead per step
    io_ms: float                  # time some read was in flight
    io_hidden_ms: float           # ... of which a device interval was running
    io_bytes: float
    cpu_ms: float                 # time the CPU pool was busy
    cpu_hidden_ms: float
    routed: int                   # (row, expert) pairs, all steps
    hits: int                     # distinct experts per layer per step, summed: VRAM hits, CPU pool, uploaded
    cpu_experts: int
    fetched: int
    expert_bytes: float           # per step: weight bytes the CPU pool read plus bytes uploaded
    ram_hits: int = 0             # distinct misses of VRAM the RAM tier held, all steps
    ssd_reads: int = 0            # ... read from the file
    expert_ssd_bytes: float = 0.0     # per step: bytes read from the file for experts, and for PLE rows
    ple_ssd_bytes: float = 0.0
    io_busy_ms: float = 0.0       # per step: read time in flight behind device, CPU-pool or upload work,
    io_host_ms: float = 0.0       # behind host work (the driver busy in Python),
    io_exposed_ms: float = 0.0    # and exposed: the driver only waited (the three sum to io_ms)
    ple_rows: int = 0             # PLE rows asked, all steps, and of them from the RAM cache
    ple_hits: int = 0
    peak_rss: int = 0             # bytes: the process's high-water mark at the phase's last step
    prefetch: tuple = (0, 0, 0, 0)    # all steps: reads (experts) the prefetch started, VRAM misses, misses it
                                      # predicted, bytes started
    stream_steps: int = 0         # steps that streamed their experts; per such step: bytes copied, the device's
    stream_bytes: float = 0.0     # copy time, and of it what the posts waited for (exposed)
    stream_copy_ms: float = 0.0
    stream_exposed_ms: float = 0.0
    mapped_steps: int = 0         # steps run as mapped tokens; all steps: misses read in place, and their bytes
    mapped_experts: int = 0
    mapped_bytes: float = 0.0
    gc_n: int = 0                 # all steps: the collector's runs, and per step their pause time; the longest
    gc_ms: float = 0.0
    gc_max_ms: float = 0.0
    mapped_dev: tuple = (0, 0.0, 0.0, 0, 0, 0.0)  # mapped steps timed on the device: their count, then sums of
                                                  # table ms, graph ms, experts promoted, their bytes, copy ms

    @property
    def tok_s(self) -> float:
        return 1e3 * self.tokens / self.wall_ms if self.wall_ms > 0 else 0.0


def last_request(records: list[dict]) -> list[dict]:
    """The steps of the newest request in records (one request a step: the benches' measured request)."""
    last = max(row[0] for r in records for row in r["rows"])
    return [r for r in records if r["rows"][0][0] == last]


def summarize(records: list[dict]) -> list[PhaseSummary]:
    device = union((s[2], s[3]) for r in records for s in r["spans"] if s[0] in DEVICE)
    out = []
    for phase in ("prefill", "decode", "mixed"):
        rs = [r for r in records if r["kind"] == phase]
        if not rs:
            continue
        n = len(rs)
        sums = defaultdict(float)
        for r in rs:
            sums["total"] += r["t1"] - r["t0"]
            for kind, _, a, b in r["spans"]:
                sums[kind] += b - a
        ms = {k: sums[k] / n for k in KINDS}
        ms["total"] = sums["total"] / n
        ms["other"] = ms["total"] - sum(ms[k] for k in KINDS)
        dev = sum(ms[k] for k in DEVICE)
        wait = sum(ms[k] for k in WAITS)
        io_u = union((x[2], x[3]) for r in rs for x in r["io"])
        cpu_u = union((x[3], x[4]) for r in rs for x in r["cpu"])
        ex = [e for r in rs for e in r["experts"]]
        pt, dt = sum(r["prompt_tokens"] for r in rs), sum(r["decode_tokens"] for r in rs)
        busy = busy_intervals([s for r in rs for s in r["spans"]], [(x[3], x[4]) for r in rs for x in r["cpu"]])
        io_busy, io_host, io_exposed = split_io(io_u, busy, wait_intervals([s for r in rs for s in r["spans"]]))
        ple = [r.get("ple", (0, 0)) for r in rs]
        sm = [x for r in rs if r.get("experts_mode") == "stream" for x in r.get("stream", [])]
        ns = max(sum(r.get("experts_mode") == "stream" for r in rs), 1)
        gcs = [b - a for r in rs for _, a, b in r.get("gc", ())]
        md = [r["mapped_dev"] for r in rs if "mapped_dev" in r]
        out.append(PhaseSummary(
            phase, n, pt + dt, pt, dt, sums["total"], ms, dev, wait, ms["total"] - dev - wait,
            sum(b - a for a, b in io_u) / n, overlap(io_u, device) / n, sum(x[1] for r in rs for x in r["io"]) / n,
            sum(b - a for a, b in cpu_u) / n, overlap(cpu_u, device) / n,
            sum(e[1] for e in ex), sum(e[2] for e in ex), sum(e[3] for e in ex), sum(e[4] for e in ex),
            sum(e[5] + e[6] for e in ex) / n,
            sum(e[7] for e in ex if len(e) > 8), sum(e[8] for e in ex if len(e) > 8),
            sum(x[1] for r in rs for x in r["io"] if x[0] == "expert") / n,
            sum(x[1] for r in rs for x in r["io"] if x[0] == "ple") / n,
            io_busy / n, io_host / n, io_exposed / n, sum(p[0] for p in ple), sum(p[1] for p in ple),
            max((r.get("peak_rss", 0) for r in rs), default=0),
            tuple(sum((list(r.get("prefetch", ())) + [0] * 4)[i] for r in rs) for i in range(4)),
            sum(r.get("experts_mode") == "stream" for r in rs), sum(x[2] for x in sm) / ns,
            sum(x[3] for x in sm) / ns, sum(x[4] for x in sm) / ns,
            sum(r.get("experts_mode") == "mapped" for r in rs), sum(r.get("mapped", (0, 0))[0] for r in rs),
            sum(r.get("mapped", (0, 0))[1] for r in rs), len(gcs), sum(gcs) / n, max(gcs, default=0.0),
            (len(md), *(sum(x[i] for x in md) for i in range(5)))))
    return out


def _pct(a: float, b: float) -> str:
    return f"{100 * a / b:5.1f}%" if b > 0 else "    -"


def format_summary(phases: list[PhaseSummary], prefixes: list[dict] = ()) -> str:
    """The table of every step kind; `prefixes` the trace's prefix records (load(path, "prefix"))."""
    if not phases:
        return "no steps in the trace"
    lines = []
    if prefixes:
        lines.append(f"prefix reuse: {len(prefixes)} requests resumed from a snapshot, "
                     f"{sum(p['reused'] for p in prefixes)} of their {sum(p['prompt'] for p in prefixes)} prompt "
                     f"tokens not computed again")
    for p in phases:
        what = {"prefill": f"{p.prompt_tokens} prompt tokens", "decode": f"{p.decode_tokens} decoded tokens",
                "mixed": f"{p.prompt_tokens} prompt + {p.decode_tokens} decoded tokens"}[p.phase]
        lines.append(f"{p.phase}: {p.steps} steps, {what}, {p.tokens / p.steps:.1f} tokens/step, "
                     f"{p.ms['total']:.3f} ms/step, {p.tok_s:.1f} tok/s")
        lines.append(f"  {'stage':32s} {'ms/step':>10s} {'share':>7s}")
        for k in (*KINDS, "other"):
            lines.append(f"  {LABELS[k]:32s} {p.ms[k]:10.3f} {_pct(p.ms[k], p.ms['total']):>7s}")
        lines.append(f"  {'total (measured wall)':32s} {p.ms['total']:10.3f} {_pct(1, 1):>7s}")
        lines.append(f"  device {p.device_ms:.3f} ms + waits {p.wait_ms:.3f} ms + host overhead {p.host_ms:.3f} ms "
                     f"(wall - device - waits) per step")
        lines.append(f"  I/O: {p.io_bytes / 1e3:.1f} kB/step, in flight {p.io_ms:.3f} ms/step, hidden behind device "
                     f"{p.io_hidden_ms:.3f} ms ({_pct(p.io_hidden_ms, p.io_ms).strip()})")
        lines.append(f"  CPU pool: busy {p.cpu_ms:.3f} ms/step, hidden behind device {p.cpu_hidden_ms:.3f} ms "
                     f"({_pct(p.cpu_hidden_ms, p.cpu_ms).strip()})")
        distinct = p.hits + p.cpu_experts + p.fetched + p.mapped_experts
        lines.append(f"  experts: {p.routed / p.tokens:.1f} routed/token, {distinct / p.steps:.1f} distinct/step: "
                     f"VRAM hits {_pct(p.hits, distinct).strip()}, CPU {p.cpu_experts / p.steps:.1f}/step, fetched "
                     f"to VRAM {p.fetched / p.steps:.1f}/step, {p.expert_bytes / 1e6:.2f} MB/step")
        if p.mapped_steps:
            lines.append(f"  mapped: {p.mapped_steps} of {p.steps} steps ran as one graph reading their VRAM misses "
                         f"in place from pinned host memory: {p.mapped_experts / p.steps:.1f} experts/step, "
                         f"{p.mapped_bytes / p.steps / 1e6:.2f} MB/step")
        nt, tab, graph, npro, bpro, mspro = p.mapped_dev
        if nt:
            rate = bpro / mspro / 1e6 if mspro else 0.0
            lines.append(f"  mapped, on the device ({nt} steps timed): address table copy {tab / nt:.3f} ms + graph "
                         f"{graph / nt:.3f} ms a step; promotions {npro / nt:.1f} experts, {bpro / nt / 1e6:.2f} MB a "
                         f"step, copied in {mspro / nt:.3f} ms ({rate:.1f} GB/s) beside the next token's graph")
        pct = lambda x, y: _pct(x, y).strip()
        lines.append(f"  tiers: distinct experts/step from VRAM {p.hits / p.steps:.1f} ({pct(p.hits, distinct)}), "
                     f"RAM {p.ram_hits / p.steps:.1f} ({pct(p.ram_hits, distinct)}), SSD {p.ssd_reads / p.steps:.1f} "
                     f"({pct(p.ssd_reads, distinct)}); PLE rows {p.ple_rows / p.steps:.1f}/step, "
                     f"{pct(p.ple_hits, p.ple_rows)} from the RAM cache")
        kb = p.steps / p.tokens / 1e3                    # per step -> kB per token
        lines.append(f"  SSD: {p.io_bytes * kb:.1f} kB/token (experts {p.expert_ssd_bytes * kb:.1f}, PLE "
                     f"{p.ple_ssd_bytes * kb:.1f}); in flight {p.io_ms:.3f} ms/step: hidden behind device, CPU pool "
                     f"or uploads {p.io_busy_ms:.3f} ms ({pct(p.io_busy_ms, p.io_ms)}), behind host work "
                     f"{p.io_host_ms:.3f} ms, exposed {p.io_exposed_ms:.3f} ms")
        if p.stream_steps:
            rate = p.stream_bytes / p.stream_copy_ms / 1e6 if p.stream_copy_ms else 0.0
            lines.append(f"  streamed: {p.stream_steps} of {p.steps} steps copied every expert their layers lack in "
                         f"VRAM, {p.stream_bytes / 1e9:.2f} GB/step in {p.stream_copy_ms:.1f} ms on the device "
                         f"({rate:.1f} GB/s), {pct(p.stream_copy_ms - p.stream_exposed_ms, p.stream_copy_ms)} "
                         f"hidden behind compute ({p.stream_exposed_ms:.1f} ms/step exposed)")
        started, misses, predicted, pbytes = p.prefetch
        if started and p.mapped_steps:
            lines.append(f"  prefetch (mapped_reads prefetch): {started / p.steps:.1f} experts/step, "
                         f"{pbytes / p.steps / 1e6:.2f} MB/step fetched a layer early beside the compute; "
                         f"{pct(predicted, misses)} of the VRAM misses predicted, {pct(predicted, started)} of the "
                         f"experts fetched used")
        elif started:
            lines.append(f"  prefetch (HostConfig.prefetch): {started / p.steps:.1f} reads started/step, "
                         f"{pct(predicted, misses)} of the VRAM misses predicted, {pct(predicted, started)} of the "
                         f"reads used")
        if p.gc_n:
            lines.append(f"  Python's collector: {p.gc_n} runs, {p.gc_ms:.3f} ms/step of pauses (every thread stopped, "
                         f"inside the stages above), the longest {p.gc_max_ms:.3f} ms")
        if p.peak_rss:
            lines.append(f"  peak RSS {p.peak_rss / 2**20:.1f} MiB (the process's high-water mark; the page cache "
                         f"is not counted)")
    return "\n".join(lines)
