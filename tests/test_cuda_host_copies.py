"""The CUDA backend's host side of an expert copy, run without a GPU (the driver's copy call recorded): a blob in a
pinned cell laid out as a slot is one copy of the whole slot, one laid out otherwise three, one outside the cells
goes through pinned staging at the slot's offsets; the kernels' slices are the blob's own views where the layer's
types need no conversion. The GPU tests run the same code against the device."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from strata.cuda import backend as cb
from strata.cuda import driver as drv
from strata.cuda.weights import device_rows
from strata.host.cells import Cells, numpy_chunks
from strata.kernels.gemv import device_row_bytes
from strata.quant import QType, random_blocks, row_bytes


class FakeHost:
    """A pinned staging buffer's stand-in: numpy memory with .ptr and .array like drv.HostBuffer."""

    def __init__(self, nbytes):
        self.mem = np.zeros(nbytes, np.uint8)
        self.ptr = self.mem.__array_interface__["data"][0]

    def array(self, dtype, shape, offset=0):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.mem[offset:offset + n].view(dtype).reshape(shape)


def backend(qt, E, Fn, monkeypatch):
    be = object.__new__(cb.CudaBackend)
    al = lambda n: (n + 255) // 256 * 256
    be.cfg = SimpleNamespace(n_embd=E, n_ff_exp=Fn)
    be.file_types = [(int(qt),) * 3]
    be._as_is = [cb.as_is_shapes(be.file_types[0], E, Fn)]
    be.slot_parts = (al(Fn * device_row_bytes(qt, E)), al(Fn * device_row_bytes(qt, E)),
                     al(E * device_row_bytes(qt, Fn)))
    be.slot_bytes = sum(be.slot_parts)
    be.cells = Cells(be.slot_bytes, numpy_chunks)
    be.slot_buf = SimpleNamespace(ptr=1 << 40)
    be.side, be._mark_needed = "side", False
    be.h_load = [FakeHost(be.slot_bytes) for _ in range(cb.LOAD_STAGING)]
    be.ev_load = [SimpleNamespace(record=lambda s: None, synchronize=lambda what: None)
                  for _ in range(cb.LOAD_STAGING)]
    be.load_used, be.load_turn = [False] * cb.LOAD_STAGING, 0
    copies = []
    monkeypatch.setattr(drv.CopyBatch, "ok", False)             # a batch goes as one recorded call a copy
    be._copies = drv.CopyBatch(be.side)
    monkeypatch.setattr(drv, "memcpy_htod_async",
                        lambda dst, src, n, stream, what, *args: copies.append((dst, src, n, what % args)))
    return be, copies


def blob(be, qt, E, Fn, pinned: bool, seed=0):
    """An expert's three slices back to back (as ExpertBlob lays them out), in a cell or in numpy memory."""
    sizes = (Fn * row_bytes(qt, E), Fn * row_bytes(qt, E), E * row_bytes(qt, Fn))
    buf = be.cells.take(sum(sizes)) if pinned else np.empty(sum(sizes), np.uint8)
    rng = np.random.default_rng(seed)
    at = np.cumsum([0, *sizes])
    rows = (Fn, Fn, E)
    parts = [buf[a:b].reshape(r, -1) for a, b, r in zip(at[:-1], at[1:], rows)]
    for p, n_in in zip(parts, (E, E, Fn)):
        p[:] = random_blocks(qt, (p.shape[0], n_in), rng, 1.0).reshape(p.shape)
    return parts


@pytest.mark.parametrize("qt,E,Fn,pinned,n_copies", [
    (QType.Q2_0, 2560, 640, True, 1),       # flash: 460,800-byte slices, laid out as the slot is
    (QType.Q8_0, 64, 32, True, 3),          # 2,176-byte slices: the slot's parts are 256-aligned apart
    (QType.Q8_0, 64, 32, False, 1),         # not in a cell: staged, one copy of the whole slot
])
def test_expert_copy_paths(qt, E, Fn, pinned, n_copies, monkeypatch):
    be, copies = backend(qt, E, Fn, monkeypatch)
    g, u, d = blob(be, qt, E, Fn, pinned)
    parts = be._device_parts(0, 3, g, u, d, "test")
    assert all(a is b for a, b in zip(parts, (g, u, d)))          # no conversion: the blob's own views
    for p, ref, n_in in zip(parts, (g, u, d), (E, E, Fn)):
        assert np.array_equal(p, device_rows(ref, qt, ref.shape[0], n_in))
    slot = 5
    be._copy_into(slot, parts, (0, 3, slot), after_launches=False)
    be._copies.flush(cb.COPY_WHAT, 0, 3, slot)                  # a pinned cell's copies are queued until a flush
    assert len(copies) == n_copies
    base = be.slot_buf.ptr + slot * be.slot_bytes
    assert all(c[3] == "expert 0.3 -> slot 5" for c in copies)
    if not pinned:                                              # the staging buffer holds the slot's image
        dst, src, n, _ = copies[0]
        st = be.h_load[0]
        assert (dst, src, n) == (base, st.ptr, be.slot_bytes)
        offs = (0, be.slot_parts[0], be.slot_parts[0] + be.slot_parts[1])
        for p, o in zip(parts, offs):
            assert np.array_equal(st.mem[o:o + p.nbytes], p.reshape(-1))
        return
    ptr = g.__array_interface__["data"][0]
    if n_copies == 1:
        assert copies == [(base, ptr, be.slot_bytes, "expert 0.3 -> slot 5")]
    else:
        offs = (0, be.slot_parts[0], be.slot_parts[0] + be.slot_parts[1])
        assert [(c[0] - base, c[2]) for c in copies] == [(o, p.nbytes) for o, p in zip(offs, parts)]
        assert [c[1] for c in copies] == [p.__array_interface__["data"][0] for p in parts]


def test_a_slice_the_kernels_cannot_take_is_converted(monkeypatch):
    """Rows of another shape than the file type's are not taken as they are: device_rows checks them."""
    be, _ = backend(QType.Q8_0, 64, 32, monkeypatch)
    g, u, d = blob(be, QType.Q8_0, 64, 32, True)
    with pytest.raises(cb.BackendError, match="layer 0 expert 3"):
        be._device_parts(0, 3, g.reshape(-1)[:-34].reshape(-1, 34)[:32], u, d, "test")


def with_cache(be, n_layer: int, n_exp: int, n_slots: int) -> None:
    """The fake backend as experts="host" with n_slots cache slots for n_layer layers of n_exp experts."""
    be.cfg.n_layer, be.cfg.n_expert = n_layer, n_exp
    be.file_types *= n_layer
    be._as_is *= n_layer
    be.experts, be.n_slots, be._failed, be._loaded, be._loaded_slots, be._retab = "host", n_slots, None, [], [], []
    be.n_lend, be.n_lend_act, be._taken = 0, 0, None
    be._slot_of, be._owner = {}, [None] * n_slots
    be._slots = np.full((n_layer, n_exp), -1, np.int32)


def test_cache_bookkeeping_is_one_map(monkeypatch):
    """load_expert replaces a slot's expert: resident() (vectorized) and the slot map agree after every load,
    the old expert is no longer resident, and every load copied its slices."""
    qt, E, Fn = QType.Q8_0, 64, 32
    be, copies = backend(qt, E, Fn, monkeypatch)
    n_layer, n_exp, n_slots = 3, 8, 4
    with_cache(be, n_layer, n_exp, n_slots)
    rng = np.random.default_rng(1)
    held: dict[int, tuple[int, int]] = {}
    for i in range(40):
        layer, expert, slot = int(rng.integers(n_layer)), int(rng.integers(n_exp)), int(rng.integers(n_slots))
        if (layer, expert) in be._slot_of:
            continue
        n0 = len(copies)
        be.load_expert(layer, expert, slot, *blob(be, qt, E, Fn, True, seed=i))
        assert len(copies) == n0                     # queued: loads_done (or the next post) sends them
        be.loads_done()
        assert len(copies) == n0 + 3
        held = {s: k for s, k in held.items() if k != (layer, expert)}
        held[slot] = (layer, expert)
        want = np.zeros((n_layer, n_exp), bool)
        for ly, e in held.values():
            want[ly, e] = True
        got = np.stack([be.resident(ly, np.arange(n_exp)) for ly in range(n_layer)])
        assert np.array_equal(got, want)
        assert {k: s for s, k in held.items()} == be._slot_of
    assert len(copies) == 3 * len(be._loaded)


class FakeEvent:
    def __init__(self):
        self.done, self.recorded = False, 0

    def record(self, stream):
        self.recorded += 1
        self.done = False

    def query(self, what):
        return self.done

    def synchronize(self, what):
        self.done = True

    def elapsed_ms(self, start):
        return 2.5


def test_mapped_table_follows_the_loads(monkeypatch):
    """A mapped token's address table (_sync_ptab): a loaded slot is read from host memory until its copies' event
    is done, then from VRAM; an evicted expert goes back to its host address; only the rows of the layers that
    changed are copied, on the main stream (by a kernel); a step that is not a mapped token waits for the pending
    loads."""
    qt, E, Fn = QType.Q8_0, 64, 32
    be, copies = backend(qt, E, Fn, monkeypatch)
    n_layer, n_exp, n_slots, k = 4, 8, 3, 2
    with_cache(be, n_layer, n_exp, n_slots)
    be.stream = SimpleNamespace(waits=[], wait=lambda ev: be.stream.waits.append(ev))
    be.ev_loads = [FakeEvent() for _ in range(cb.LOAD_EVENTS)]
    be.loads_turn, be._inflight = 0, [None] * cb.LOAD_EVENTS
    be._pend_slot, be._pend_turns = np.full(n_slots, -1, np.int32), set()
    be._eff = np.zeros((n_layer, n_exp), bool)
    be.ptab = np.zeros((n_layer, n_exp, 3), np.uint64)
    be.h_ptab, be.b_ptab = SimpleNamespace(ptr=1 << 20, dptr=1 << 20), SimpleNamespace(ptr=1 << 30)
    be.kern, be._ptab_copy = SimpleNamespace(fn=lambda module, name: name), {}
    # the table goes by a kernel reading the mapped staging (host_copy), recorded here like the copies
    monkeypatch.setattr(cb.kgemv, "host_copy_launch", lambda fn, name, dst, src, n, off=0: SimpleNamespace(
        enqueue=lambda stream: copies.append((dst.ptr + off, src, n, name))))
    be.ev_ptab = FakeEvent()
    be.can_map = be.mapped = True
    be.ev_prom, be._prom_state, be._prom_last = [FakeEvent(), FakeEvent()], "idle", None
    be._host_addr = (np.arange(n_layer * n_exp * 3, dtype=np.uint64).reshape(n_layer, n_exp, 3) + 1) << np.uint64(8)
    at = np.array([0, be.slot_parts[0], be.slot_parts[0] + be.slot_parts[1]], np.uint64)
    be._slot_addr = np.uint64(be.slot_buf.ptr) + np.arange(n_slots, dtype=np.uint64)[:, None] * np.uint64(
        be.slot_bytes) + at
    be._retab_all = True
    dev = lambda s: np.uint64(be.slot_buf.ptr) + np.uint64(s * be.slot_bytes) + at
    rb = n_exp * 3 * 8

    be._sync_ptab()                                     # nothing loaded: every entry is the host's
    assert np.array_equal(be.ptab, be._host_addr) and copies[-1][:3] == (1 << 30, 1 << 20, n_layer * rb)
    be.load_expert(2, 5, 1, *blob(be, qt, E, Fn, True, seed=1))
    be.loads_done()
    copies.clear()
    be._sync_ptab()                                     # its copy is in flight: still read from host memory
    assert np.array_equal(be.ptab[2, 5], be._host_addr[2, 5]) and be._pend_turns == {0}
    assert [c[:3] for c in copies] == [((1 << 30) + 2 * rb, (1 << 20) + 2 * rb, rb)]
    copies.clear()
    be._sync_ptab()
    assert not copies                                   # nothing changed: no copy
    be.ev_loads[0].done = True
    be._sync_ptab()                                     # done: layer 2's row now points at slot 1
    assert np.array_equal(be.ptab[2, 5], dev(1)) and be._eff[2, 5] and not be._pend_turns
    be.load_expert(3, 0, 1, *blob(be, qt, E, Fn, True, seed=2))     # slot 1 goes to (3, 0): (2, 5) evicted
    be.loads_done()
    copies.clear()
    be._sync_ptab()
    assert np.array_equal(be.ptab[2, 5], be._host_addr[2, 5]) and np.array_equal(be.ptab[3, 0], be._host_addr[3, 0])
    assert [c[:3] for c in copies] == [((1 << 30) + 2 * rb, (1 << 20) + 2 * rb, 2 * rb)]    # rows 2..3
    be._join_pending()                                  # a per-layer step: the main stream waits for the copy
    assert be.stream.waits == [be.ev_loads[1]] and not be._pend_turns
    be._sync_ptab()
    assert np.array_equal(be.ptab[3, 0], dev(1))
    be._tok_eff = be._eff.copy()
    be.ids_all = np.array([[0, 1], [2, 3], [5, 4], [0, 7]], np.int32)
    ids, res = be.token_routes()
    assert res.tolist() == [[False, False], [False, False], [False, False], [True, False]] and k == ids.shape[1]
    # the promotions' copy time (mapped_timing): the first load after a token opens the window on the side
    # stream, the next token's table sync closes it, and its time is read once the end event has completed
    be.side, be.ev_mark, be._mark_needed = SimpleNamespace(wait=lambda ev: None), FakeEvent(), True
    parts = blob(be, qt, E, Fn, True, seed=3)
    be.load_expert(1, 2, 2, *parts)
    be.load_expert(1, 3, 0, *blob(be, qt, E, Fn, True, seed=4))
    assert be.ev_prom[0].recorded == 1 and be._prom_state == "open"
    copies.clear()
    be._sync_ptab()                                     # queued loads go before the event that marks them
    assert [c[3] for c in copies] == ["expert uploads"] * 6 + ["expert address table"]
    assert be._prom_state == (2, 2 * sum(p.nbytes for p in parts)) and be.ev_prom[1].recorded == 1
    be._harvest_promotions()
    assert be._prom_last is None                         # not completed yet
    be.ev_prom[1].done = True
    be._harvest_promotions()
    assert be._prom_last == (2, 2 * sum(p.nbytes for p in parts), 2.5) and be._prom_state == "idle"
