"""A batch of routed SwiGLU experts on the CPU in two compiled parallel calls: no Python per expert or per row.

    expert_batch(gate_w, up_w, down_w, ids, x, out, wt_gu=..., wt_d=...)   # stacked weights, e.g. GGUF views
    expert_batch_at(addr, x, out, F, wt_gu=..., wt_d=...)                   # experts anywhere (host blobs)
    expert_batch_rows(addr, X, offsets, rows, out, F, wt_gu=..., wt_d=...)  # several tokens' experts at once

m = experts in the batch, E = hidden size (x, out), F = expert width (gate/up rows, down's K); P = (token, expert)
pairs, expert j's in [offsets[j], offsets[j + 1]) (one token: P = m, a pair per expert).

    1. gate_up (one parallel loop): each token's activation once (gate and up and all its experts share it),
       then the gate and up rows of all m experts in work items of (expert, row block) that the nt threads
       claim in order; an item runs its block over all of the expert's pairs while the block is in cache.
    2. h = silu(g) * u for all P in numpy: numpy's float32 exp is not libm's (numba's differs on ~40% of
       inputs) and the result must equal reference.moe.expert_ffn bit for bit.
    3. down (one parallel loop): each h's activation for the down type, a pair an item; then the down
       rows of all m experts as in 1.

Every row is the kernel call matvec_prepared makes, on the activation prepare_activation makes (contract
mode), or the same dequantize + float64 dot as its exact mode: out equals the per-matvec path bit for bit
at any thread count. The float weight types take that per-matvec path expert by expert (expert_one), as does
a caller whose gate type differs from up's.

Threads: numba's threading layer as numba picks it (NUMBA_THREADING_LAYER, else tbb when the `tbb` package
is installed, else omp when the OS has libgomp.so.1, else workqueue; a plain `pip install numba` on Linux
gives omp wherever the OS ships libgomp, workqueue elsewhere). workqueue aborts the process on concurrent
launches, so every launch here holds one process-wide lock: safe from any thread under all three. The thread
count (numba.set_num_threads, a per-thread setting) is set under that lock when it changes. Work is handed out
in small items that each thread claims in turn, so a thread that starts late does not hold up the call.

omp is GNU OpenMP, whose idle workers by default spin ~300,000 pauses (~10 ms) after every parallel region,
burning the cores the event loop and the I/O threads need between batches (on the 2-vCPU dev VM, whose CPU
quota the spinning uses up, a 10-expert call then took 32-40 ms instead of 2.5). Unless OMP_WAIT_POLICY or
GOMP_SPINCOUNT is set, this module sets OMP_WAIT_POLICY=passive (idle workers sleep at once) before numba loads
libgomp at its first parallel call; OMP_WAIT_POLICY=active trades that CPU for a faster wake-up per region.

numba's on-disk cache is keyed on this file only: the kernels compiled into these functions come from
kernels.py, dequant.py and activation.py, so after editing those, delete strata/quant/__pycache__.
"""

from __future__ import annotations

import os
import threading
from typing import NamedTuple

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.core.cpu_options import ParallelOptions
from numba.extending import intrinsic, overload
from numba.np.arrayobj import make_array, populate_array

from strata.quant import kernels as K
from strata.quant.activation import _iq4_xs_act, _q2_0_act, _q8_0, _q8_k
from strata.quant.dequant import _KERNELS as _DEQUANT
from strata.quant.formats import ACT_TYPE, F16_TO_F32, QK_K, QType, block_size, qtype, row_bytes
from strata.quant.matvec import _EXACT_CHUNK_BYTES, matvec
from strata.quant.matvec import _KERNELS as _MATVEC
from strata.quant.simd import HAS_AVX2
from strata.reference.common import F32, silu

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "passive"            # read by libgomp when numba loads it (see above)

_JIT = dict(nogil=True, cache=True, fastmath=False)
# prange only: no implicit parallel loops (np.zeros would be one more launch) and no fusion (down's two loops must
# stay two: the second reads what the first writes)
_PARALLEL = ParallelOptions({"comprehension": False, "reduction": False, "inplace_binop": False, "setitem": False,
                             "numpy": False, "stencil": False, "fusion": False, "prange": True})
ITEM_BYTES = 32 << 10               # weight bytes of one work item (per matrix): ~4 us of kernel on one core
SERIAL_BYTES = 2 << 20              # below this many weight bytes through the kernels (pairs x expert), one thread
_LAUNCH = threading.Lock()          # one parallel launch at a time (workqueue is not thread-safe)
_THREADS = threading.local()        # .n: the thread count this thread last gave numba
f32 = np.float32


def _use_threads(nt: int) -> None:
    """numba.set_num_threads(nt) (a per-thread setting), skipped when this thread set nt last: the call costs ~2 us,
    and most launches use the count the one before them did. Call under _LAUNCH."""
    if getattr(_THREADS, "n", 0) != nt:
        numba.set_num_threads(nt)
        _THREADS.n = nt


# ---- memory by address ----------------------------------------------------------------------------------------

_RO_ROWS = types.Array(types.uint8, 2, "C", readonly=True)


@intrinsic
def _mat(typingctx, addr, rows, rb):
    """The uint8 (rows, rb) C-contiguous matrix at address addr, read-only: the array type the matvec kernels
    are already compiled for (GGUF mappings are read-only), so they are not compiled a second time."""
    def codegen(context, builder, sig, args):
        shape = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:])]
        ary = make_array(_RO_ROWS)(context, builder)
        populate_array(ary, data=builder.inttoptr(args[0], cgutils.int8_t.as_pointer()), shape=shape,
                       strides=[shape[1], cgutils.intp_t(1)], itemsize=cgutils.intp_t(1), meminfo=None)
        return ary._getvalue()
    return _RO_ROWS(addr, rows, rb), codegen


def _rows(aux, j):
    """(a[j] for a in aux): row j of an activation's per-type extras."""


@overload(_rows)
def _rows_impl(aux, j):
    if len(aux) == 0:
        return lambda aux, j: ()
    if len(aux) == 1:
        return lambda aux, j: (aux[0][j],)
    return lambda aux, j: (aux[0][j], aux[1][j])


# ---- activations, one row per expert: alloc(k, n) -> (q (k, ·), d (k, ·), aux, v (k, ·)), prep(x, row j) ------
# Row j holds what prepare_activation(x_j, wt) holds (activation.py), in the same layout.

@njit(**_JIT)
def _alloc_q8_0(k, n):
    return np.empty((k, n), np.int8), np.empty((k, n // 32), f32), (), np.empty((k, 0), f32)


@njit(**_JIT)
def _prep_q8_0(x, q, d, aux, v):
    _q8_0(x, q, d, np.empty(d.shape[0], f32), np.empty(d.shape[0], np.int32))


@njit(**_JIT)
def _alloc_q8_1(k, n):
    return np.empty((k, n), np.int8), np.empty((k, n // 32), f32), (np.empty((k, n // 32), f32),), np.empty((k, 0), f32)


@njit(**_JIT)
def _prep_q8_1(x, q, d, aux, v):
    _q8_0(x, q, d, aux[0], np.empty(d.shape[0], np.int32))


@njit(**_JIT)
def _alloc_q2_0(k, n):
    nb = n // 64
    groups = nb // 4 + (nb % 4) // 2 + nb % 2
    return (np.empty((k, n), np.int8), np.empty((k, n // 32), f32),
            (np.empty((k, 8 * groups), f32), np.empty((k, 8 * groups), np.int32)), np.empty((k, 0), f32))


@njit(**_JIT)
def _prep_q2_0(x, q, d, aux, v):
    nd = d.shape[0]
    _q2_0_act(x, np.empty(x.shape[0], np.int8), d, np.empty(nd, f32), np.empty(nd, np.int32), q, aux[0], aux[1])


@njit(**_JIT)
def _alloc_q8_k(k, n):
    return (np.empty((k, n), np.int8), np.empty((k, n // QK_K), f32), (np.empty((k, n // 16), np.int16),),
            np.empty((k, 0), f32))


@njit(**_JIT)
def _prep_q8_k(x, q, d, aux, v):
    _q8_k(x, q, d, aux[0])


@njit(**_JIT)
def _prep_iq4_xs(x, q, d, aux, v):
    _iq4_xs_act(x, np.empty(x.shape[0], np.int8), d, aux[0], q)


@njit(**_JIT)
def _alloc_exact(k, n):
    return np.empty((k, 0), np.int8), np.empty((k, 0), f32), (), np.empty((k, n), f32)


@njit(**_JIT)
def _prep_exact(x, q, d, aux, v):
    for i in range(x.shape[0]):                # a loop: `v[:] = x` costs ~5 s of compilation
        v[i] = x[i]


# ---- per weight type and mode, chosen at compile time by a literal code = 2 * ggml type id + exact -------------
# (Passing the kernels as arguments would do the same, but a signature holding a dispatcher never hits numba's
# on-disk cache: dispatchers pickle with a per-process uuid, so every process would recompile, ~10 s a type.)

class _Ops(NamedTuple):
    alloc: object          # (k, n) -> (q, d, aux, v)
    prep: object           # (x, q[j], d[j], aux rows j, v[j])
    kern: object           # the matvec kernel; in exact mode the dequantizer
    tables: tuple          # its extra tables (grids, signs)
    bs: int                # block size


def _ops(wt: QType, exact: bool) -> _Ops:
    if exact:
        return _Ops(_alloc_exact, _prep_exact, *_DEQUANT[wt], block_size(wt))
    if wt == QType.Q2_0:
        alloc, prep = _alloc_q2_0, _prep_q2_0
    elif wt == QType.IQ4_XS:
        alloc, prep = _alloc_q8_k, _prep_iq4_xs
    else:
        alloc, prep = {QType.Q8_0: (_alloc_q8_0, _prep_q8_0), QType.Q8_1: (_alloc_q8_1, _prep_q8_1),
                       QType.Q8_K: (_alloc_q8_k, _prep_q8_k)}[ACT_TYPE[wt]]
    return _Ops(alloc, prep, *_MATVEC[wt], block_size(wt))


def _code_ops(code) -> _Ops | None:
    """The ops of a literal code; None (no match, numba tries the literal next) for a plain integer type."""
    if not isinstance(code, types.IntegerLiteral):
        return None
    return _ops(QType(code.literal_value // 2), bool(code.literal_value % 2))


def _alloc(code, k, n):
    """Activation arrays for k vectors of n."""


@overload(_alloc, prefer_literal=True)
def _alloc_impl(code, k, n):
    if (ops := _code_ops(code)) is not None:
        fn = ops.alloc
        return lambda code, k, n: fn(k, n)


def _prep(code, x, q, d, aux, v):
    """One row of _alloc's arrays from x."""


@overload(_prep, prefer_literal=True)
def _prep_impl(code, x, q, d, aux, v):
    if (ops := _code_ops(code)) is not None:
        fn = ops.prep
        return lambda code, x, q, d, aux, v: fn(x, q, d, aux, v)


def _apply(code, w, r0, r1, q, d, aux, v, src, out, p0, p1, t, tables):
    """out[p, r] = w[r] . activation src[p] (row src[p] of _alloc's arrays) for r0 <= r < r1 and p0 <= p < p1 (t:
    F16_TO_F32; tables: the kernel's): one weight block for many activations while it is in cache."""


@overload(_apply, prefer_literal=True, inline="always")
def _apply_impl(code, w, r0, r1, q, d, aux, v, src, out, p0, p1, t, tables):
    if (ops := _code_ops(code)) is None:
        return None
    if code.literal_value % 2:
        return (lambda code, w, r0, r1, q, d, aux, v, src, out, p0, p1, t, tables:
                _exact_apply(code, w, r0, r1, v, src, out, p0, p1, t, tables))
    fn = ops.kern

    def impl(code, w, r0, r1, q, d, aux, v, src, out, p0, p1, t, tables):
        for p in range(p0, p1):
            a = src[p]
            fn(w, q[a], d[a], _rows(aux, a), out[p], r0, r1, t, *tables)
    return impl


def _dequant(code, blocks, y, t, tables):
    """Exact mode: blocks uint8 (nb, type_size) -> y float32 (nb, block_size)."""


@overload(_dequant, prefer_literal=True)
def _dequant_impl(code, blocks, y, t, tables):
    if (ops := _code_ops(code)) is not None:
        fn = ops.kern
        return lambda code, blocks, y, t, tables: fn(blocks, y, t, *tables)


def _block(code):
    """The weight type's block size (a constant)."""


@overload(_block, prefer_literal=True)
def _block_impl(code):
    if (ops := _code_ops(code)) is not None:
        bs = ops.bs
        return lambda code: bs


@njit(**_JIT)
def _exact_apply(code, w, r0, r1, v, src, out, p0, p1, t, tables):
    """matvec_prepared's exact mode: a few rows at a time dequantized into scratch (once for all p), dotted with
    v[src[p]] in float64."""
    bs = _block(code)
    n, rb = v.shape[1], w.shape[1]
    nb = n // bs                                   # blocks per row
    step = max(1, _EXACT_CHUNK_BYTES // (4 * n))
    scratch = np.empty(min(step, r1 - r0) * n, f32)
    for a in range(r0, r1, step):
        m = min(r1, a + step) - a
        y = scratch[:m * n]
        _dequant(code, w[a:a + m].reshape(m * nb, rb // nb), y.reshape(m * nb, bs), t, tables)
        for p in range(p0, p1):
            K.dot_rows_f64(y.reshape(m, n), v[src[p]], out[p], a)


# ---- the two parallel phases ----------------------------------------------------------------------------------

@intrinsic
def _claim(typingctx, counters, i):
    """counters[i] += 1 atomically, returning the old value: the next work item for the calling thread."""
    def codegen(context, builder, sig, args):
        ary = make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "monotonic")
    return types.int64(counters, i), codegen


@intrinsic
def _done(typingctx, counters, i):
    """counters[i] += 1 in release order: what the calling thread wrote before is seen by a thread _wait lets on."""
    def codegen(context, builder, sig, args):
        ary = make_array(sig.args[0])(context, builder, args[0])
        builder.atomic_rmw("add", builder.gep(ary.data, [args[1]]), ir.Constant(ir.IntType(64), 1), "release")
        return context.get_dummy_value()
    return types.none(counters, i), codegen


@intrinsic
def _wait(typingctx, counters, i, n):
    """Until counters[i] >= n (acquire order), sched_yield: a thread that was preempted mid-item gets the CPU back."""
    def codegen(context, builder, sig, args):
        ary = make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        n = context.cast(builder, args[2], sig.args[2], types.int64)
        sched_yield = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        check, spin, past = (builder.append_basic_block(b) for b in ("check", "spin", "past"))
        builder.branch(check)
        builder.position_at_end(check)
        builder.cbranch(builder.icmp_signed("<", builder.load_atomic(ptr, "acquire", 8), n), spin, past)
        builder.position_at_end(spin)
        builder.call(sched_yield, [])
        builder.branch(check)
        builder.position_at_end(past)
        return context.get_dummy_value()
    return types.none(counters, i, n), codegen


@njit(inline="always", **_JIT)
def _prep_all(code, x, used, q, d, aux, v, items):
    """In a parallel loop: claim rows i of x (items[0]) and prepare the used ones into row i of _alloc's arrays, then
    wait until every row is through (items[1]): a barrier inside the loop, one parallel launch less. A thread waits
    only on rows that running threads have claimed, so no order of the threads can deadlock it."""
    i = _claim(items, 0)
    while i < x.shape[0]:
        if used[i]:
            _prep(code, x[i], q[i], d[i], _rows(aux, i), v[i])
        _done(items, 1)
        i = _claim(items, 0)
    _wait(items, 1, x.shape[0])


def _make_phases(code: int):
    """(gate_up, down) for one weight type and mode. code is a closure constant, so numba types it as a literal
    (the overloads above pick their kernels by it) and caches each code's functions on disk.

    Expert j serves pairs p in [offsets[j], offsets[j + 1]). Work items are (expert, block of `per` rows), in order;
    each of the nt threads claims the next one until none is left, so a thread that starts late (woken late,
    preempted) leaves its share to the others. An item applies its block to all of the expert's pairs."""

    @njit(parallel=_PARALLEL, **_JIT)
    def gate_up(rb, addr, x, offsets, rows, gu, per, t, tables, nt):
        # addr: uint64 (m, 3), columns 0, 1: expert j's gate and up rows, uint8 (F, rb); x: (T, E); offsets: (m + 1,);
        # rows: (P,), pair p's row of x; gu: (2, P, F)
        m, f = addr.shape[0], gu.shape[2]
        q, d, aux, v = _alloc(code, x.shape[0], x.shape[1])
        used = np.zeros(x.shape[0], np.bool_)
        for p in range(rows.shape[0]):
            used[rows[p]] = True
        nblk = -(-f // per)
        items = np.zeros(3, np.int64)
        for _ in prange(nt):
            _prep_all(code, x, used, q, d, aux, v, items)      # each row of x once, for all its experts
            i = _claim(items, 2)
            while i < m * nblk:
                j = i // nblk
                r0 = (i - j * nblk) * per
                for g in range(2):                 # one call site: each inlined kernel costs compile time
                    _apply(code, _mat(addr[j, g], f, rb), r0, min(f, r0 + per), q, d, aux, v, rows, gu[g],
                           offsets[j], offsets[j + 1], t, tables)
                i = _claim(items, 2)

    @njit(parallel=_PARALLEL, **_JIT)
    def down(rb, addr, h, offsets, out, per, t, tables, nt):
        # addr column 2: expert j's down rows, uint8 (E, rb); h: (P, F); out: (P, E)
        m = addr.shape[0]
        n_p, e = out.shape
        q, d, aux, v = _alloc(code, n_p, h.shape[1])
        own, every = np.arange(n_p), np.ones(n_p, np.bool_)
        nblk = -(-e // per)
        items = np.zeros(3, np.int64)
        for _ in prange(nt):
            _prep_all(code, h, every, q, d, aux, v, items)     # each pair's h
            i = _claim(items, 2)
            while i < m * nblk:
                j = i // nblk
                r0 = (i - j * nblk) * per
                _apply(code, _mat(addr[j, 2], e, rb), r0, min(e, r0 + per), q, d, aux, v, own, out, offsets[j],
                       offsets[j + 1], t, tables)
                i = _claim(items, 2)

    return gate_up, down


def _rows_per_item(rows: int, rb: int, k: int, nt: int) -> int:
    """Rows per work item: ~ITEM_BYTES of weights (per matrix), but at least 4 items a thread, multiples of 8."""
    per = min(max(8, ITEM_BYTES // rb), max(8, -(-k * rows // (4 * nt))))
    return -(-per // 8) * 8


_PHASES: dict[int, tuple] = {}


def _phases(wt: QType, exact: bool) -> tuple:
    code = 2 * int(wt) + int(exact)
    if code not in _PHASES:
        _PHASES[code] = _make_phases(code)
    return _PHASES[code]


def _swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u into g: reference.common.silu's float32 operations in the same order, without temporaries."""
    s = np.negative(g)
    np.exp(s, out=s)
    np.add(F32(1.0), s, out=s)
    np.divide(F32(1.0), s, out=s)              # sigmoid(g)
    np.multiply(g, s, out=g)                   # silu(g)
    np.multiply(g, u, out=g)
    return g


# ---- entry points ---------------------------------------------------------------------------------------------

def batched(wt_gu: int, wt_d: int) -> bool:
    """Whether these weight types run in the compiled phases (the quantized ones), not expert by expert."""
    return qtype(wt_gu) in _MATVEC and qtype(wt_d) in _MATVEC


def max_threads() -> int:
    """The most threads a call can use: numba's pool (NUMBA_NUM_THREADS, default one per CPU)."""
    return numba.config.NUMBA_NUM_THREADS


def expert_batch_at(addr: np.ndarray, x: np.ndarray, out: np.ndarray, f: int, *, wt_gu: int, wt_d: int,
                    exact: bool = False, n_threads: int | None = None) -> np.ndarray:
    """out[j] = down_j @ (silu(gate_j @ x) * (up_j @ x)) for the k experts whose rows lie at addr[j].

    addr: uint64 (k, 3), the addresses of expert j's gate rows and up rows (each uint8 (F, row_bytes(wt_gu, E)),
    C-contiguous) and down rows (uint8 (E, row_bytes(wt_d, F))): the caller keeps that memory alive and
    unchanged until this returns. x: float32 (E,); out: float32 (k, E) C-contiguous; quantized types only
    (batched()). n_threads: at most that many (default max_threads()), one below SERIAL_BYTES of work. The GIL is
    released while the phases run.
    """
    x = np.ascontiguousarray(x, F32).reshape(1, -1)
    k = addr.shape[0]
    return expert_batch_rows(addr, x, np.arange(k + 1), np.zeros(k, np.int64), out, f, wt_gu=wt_gu, wt_d=wt_d,
                             exact=exact, n_threads=n_threads)


def expert_batch_rows(addr: np.ndarray, x: np.ndarray, offsets: np.ndarray, rows: np.ndarray, out: np.ndarray,
                      f: int, *, wt_gu: int, wt_d: int, exact: bool = False,
                      n_threads: int | None = None) -> np.ndarray:
    """out[p] = down_j @ (silu(gate_j @ x[rows[p]]) * (up_j @ x[rows[p]])) for offsets[j] <= p < offsets[j + 1]:
    the routed experts of several tokens in one batch, each expert's weights read once for all its tokens.

    addr: uint64 (m, 3) as in expert_batch_at; x: float32 (T, E); offsets: int64 (m + 1,) nondecreasing from 0 to
    P; rows: int64 (P,) in [0, T); out: float32 (P, E) C-contiguous. out[p] is bit for bit
    expert_batch_at(addr[j:j + 1], x[rows[p]], ...)[0]. Quantized types only (batched()).
    """
    wt_gu, wt_d = qtype(wt_gu), qtype(wt_d)
    if not batched(wt_gu, wt_d):
        raise ValueError(f"no batched kernels for {wt_gu.name}/{wt_d.name} experts: use expert_one")
    if not HAS_AVX2:
        raise RuntimeError("strata's quantized matvec kernels need an x86-64 CPU with AVX2 and F16C")
    x = np.ascontiguousarray(x, F32)
    offsets = np.ascontiguousarray(offsets, np.int64)
    rows = np.ascontiguousarray(rows, np.int64)
    m, n_p = addr.shape[0], rows.shape[0]
    if x.ndim != 2:
        raise ValueError(f"x must be float32 (T, E), got shape {x.shape}")
    t_rows, e = x.shape
    if addr.dtype != np.uint64 or addr.shape != (m, 3) or not addr.flags.c_contiguous:
        raise ValueError(f"addr must be uint64 (m, 3) C-contiguous, got {addr.dtype} {addr.shape}")
    if offsets.shape != (m + 1,) or rows.ndim != 1:
        raise ValueError(f"offsets must be int64 ({m + 1},) and rows 1-D, got {offsets.shape} and {rows.shape}")
    if offsets[0] != 0 or offsets[-1] != n_p or np.any(offsets[1:] < offsets[:-1]):
        raise ValueError(f"offsets must rise from 0 to len(rows) = {n_p}, got {offsets[0]}..{offsets[-1]}")
    if n_p and not (rows.min() >= 0 and rows.max() < t_rows):
        raise ValueError(f"rows must lie in [0, {t_rows}), got {rows.min()}..{rows.max()}")
    if out.dtype != F32 or out.shape != (n_p, e) or not out.flags.c_contiguous:
        raise ValueError(f"out must be float32 ({n_p}, {e}) C-contiguous, got {out.dtype} {out.shape}")
    rb_gu, rb_d = row_bytes(wt_gu, e), row_bytes(wt_d, f)      # ValueError unless whole blocks
    if n_p == 0:
        return out
    gu = np.empty((2, n_p, f), F32)                            # (2, P, F): gate, up outputs; h into gu[0]
    # a decode step's few experts run on one thread: a parallel call costs ~50-100 us of wake-up on the 2-vCPU VM,
    # and its barrier waits out a worker the host has descheduled
    work = n_p * (2 * f * rb_gu + e * rb_d)
    nt = 1 if work < SERIAL_BYTES else max(1, min(n_threads or max_threads(), max_threads()))
    gate_up, down = _phases(wt_gu, exact)[0], _phases(wt_d, exact)[1]
    with _LAUNCH:
        _use_threads(nt)
        gate_up(rb_gu, addr, x, offsets, rows, gu, _rows_per_item(f, rb_gu, m, nt), F16_TO_F32,
                _ops(wt_gu, exact).tables, nt)
        h = _swiglu(gu[0], gu[1])
        down(rb_d, addr, h, offsets, out, _rows_per_item(e, rb_d, m, nt), F16_TO_F32, _ops(wt_d, exact).tables, nt)
    return out


def expert_one(gate: np.ndarray, up: np.ndarray, down: np.ndarray, x: np.ndarray, *, wt_gu: int, wt_d: int,
               exact: bool = False, wt_up: int | None = None) -> np.ndarray:
    """One expert matvec by matvec on the calling thread, as reference.moe.expert_ffn over Mats: the float types'
    path, and a gate type unlike up's (wt_up, default wt_gu)."""
    wt_gu, wt_d = qtype(wt_gu), qtype(wt_d)
    wt_up = wt_gu if wt_up is None else qtype(wt_up)
    h = (silu(matvec(gate, wt_gu, x, exact)) * matvec(up, wt_up, x, exact)).astype(F32)
    return matvec(down, wt_d, h, exact)


def _per_expert(w: np.ndarray, n_expert: int, what: str) -> np.ndarray:
    """Stacked (n_expert * rows, row) or (n_expert, rows, row) weights as the 3-D view."""
    w = np.asarray(w)
    if w.ndim == 2 and n_expert and w.shape[0] % n_expert == 0:
        w = w.reshape(n_expert, w.shape[0] // n_expert, w.shape[1])
    if w.ndim != 3 or w.shape[0] != n_expert:
        raise ValueError(f"{what}: shape {w.shape} does not hold {n_expert} experts")
    return w


def group_by_expert(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids (T, k) -> (experts (U,) ascending, offsets (U+1,), pairs (P = T*k,)): expert experts[u] serves the flat
    (row * k + j) pairs[offsets[u]:offsets[u+1]], in row order."""
    flat = ids.reshape(-1)
    pairs = np.argsort(flat, kind="stable")
    experts, starts = np.unique(flat[pairs], return_index=True)
    return experts.astype(np.int32), np.append(starts, flat.size).astype(np.int64), pairs.astype(np.int64)


def expert_batch(gate_w: np.ndarray, up_w: np.ndarray, down_w: np.ndarray, ids: np.ndarray, x: np.ndarray,
                 out: np.ndarray | None = None, *, wt_gu: int, wt_d: int, exact: bool = False,
                 n_threads: int | None = None) -> np.ndarray:
    """out[j] = expert ids[j] of one layer on x: down @ (silu(gate @ x) * (up @ x)), all k in one batch; or, with
    ids (T, k) and x (T, E), out[t, j] = expert ids[t, j] on x[t]: every token's experts in one batch, each distinct
    expert's weights read once for all the tokens routed to it.

    gate_w, up_w: uint8 (n_expert * F, row_bytes) (a GGUF tensor's rows) or (n_expert, F, row_bytes) (e.g. the
    halves of a fused gate|up tensor, each expert's rows C-contiguous); down_w: (n_expert * E, row_bytes) or
    (n_expert, E, row_bytes); ids: (k,) or (T, k) experts; x: float32 (E,) or (T, E); out: float32 (k, E) or
    (T, k, E), allocated when None. Float types (F32 also as the float32 arrays Mat holds) go expert by expert.
    Returns out.
    """
    wt_gu, wt_d = qtype(wt_gu), qtype(wt_d)
    one = np.ndim(x) == 1
    x = np.ascontiguousarray(x, F32).reshape(1, -1) if one else np.ascontiguousarray(x, F32)
    t_rows, e = x.shape
    ids = np.asarray(ids).astype(np.int64).reshape(1, -1) if one else np.asarray(ids).astype(np.int64)  # (T, k)
    if ids.ndim != 2 or ids.shape[0] != t_rows:
        raise ValueError(f"ids must be (k,) with x (E,) or (T, k) with x (T, E), got {ids.shape} and {x.shape}")
    k = ids.shape[1]
    shape = (k, e) if one else (t_rows, k, e)
    if out is None:
        out = np.empty(shape, F32)
    elif out.shape != shape or out.dtype != F32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be float32 {shape} C-contiguous, got {out.dtype} {out.shape}")
    n_expert = down_w.shape[0] if down_w.ndim == 3 else down_w.shape[0] // e
    gate, up, down = (_per_expert(w, n_expert, n) for w, n in ((gate_w, "gate_w"), (up_w, "up_w"), (down_w, "down_w")))
    if ids.size and not (ids.min() >= 0 and ids.max() < n_expert):
        raise ValueError(f"expert ids must lie in [0, {n_expert}), got {ids.min()}..{ids.max()}")
    flat_out = out.reshape(t_rows * k, e)
    if not batched(wt_gu, wt_d):
        for p, i in enumerate(ids.reshape(-1)):
            flat_out[p] = expert_one(gate[i], up[i], down[i], x[p // k], wt_gu=wt_gu, wt_d=wt_d, exact=exact)
        return out
    f = gate.shape[1]
    for w, rows, rb, what in ((gate, f, row_bytes(wt_gu, e), "gate_w"), (up, f, row_bytes(wt_gu, e), "up_w"),
                              (down, e, row_bytes(wt_d, f), "down_w")):
        if w.dtype != np.uint8 or w.shape[1:] != (rows, rb) or w.strides[1:] != (rb, 1):
            raise ValueError(f"{what}: want uint8 experts of ({rows}, {rb}) C-contiguous rows, "
                             f"got {w.dtype} {w.shape} strides {w.strides}")
    experts, offsets, pairs = group_by_expert(ids)
    base = np.array([w.__array_interface__["data"][0] for w in (gate, up, down)], np.int64)
    step = np.array([w.strides[0] for w in (gate, up, down)], np.int64)
    addr = (base + experts[:, None] * step).view(np.uint64)    # (U, 3)
    grouped = np.empty((ids.size, e), F32)                     # (P, E) in the pairs' order
    expert_batch_rows(addr, x, offsets, pairs // k, grouped, f, wt_gu=wt_gu, wt_d=wt_d, exact=exact,
                      n_threads=n_threads)
    flat_out[pairs] = grouped
    return out
