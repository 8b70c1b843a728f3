"""The CUDA backend end to end, driven through the Backend protocol exactly as the scheduler drives it.

Tiny random checkpoints (tests/oracle.py) -> strata's converter -> GGUF -> CudaBackend; logits at every position
(contexts past the QSA budget, EOS mid-sequence) against transformers <= 1e-3, with every expert in VRAM, every
expert on the host, and a partial cache the host fills while the layer runs. Also: the per-stage dump against
the numpy reference, 64 replayed steps equal to the eager kernel sequence bit for bit (and the whole-token graph
equal to the per-layer graphs), and the doorbell's launch-to-host-seen latency.

Every test runs twice: on the GPU (skipped with the reason where there is none), and on the CPU through the
emulated driver (tests/emu_driver.py: host memory for the device's, every kernel through tests/kernel_emu.h, graphs
that copy their kernels' arguments at capture, side streams whose work runs only once something waits for it), so
that CI runs the backend's own code, its batch plan, graphs and stream protocol included, and not only each kernel
alone. Timing assertions are the GPU's only.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from strata.cuda import driver as drv

from kernel_emu import why_not as emu_why_not
from oracle import SPECS, build, hf_logits, rel_err, sequence
from strata.cuda.backend import CudaBackend
from strata.model.convert import convert
from strata.model.loader import load_model
from strata.reference.model import RefModel, StageDump, first_divergence
from strata.reference.moe import expert_ffn
from strata.reference.ple import NgramWindow, ple_gather, ple_rows
from strata.host.backend import ExpertPlan, Segment, Step


@pytest.fixture(scope="module", autouse=True,
                params=[pytest.param("gpu", marks=pytest.mark.gpu), "emu"])
def device(request, tmp_path_factory):
    """The rig every test of the module runs on: the GPU's driver, or the emulated one (patched in for the
    module's emulator tests, undone after them)."""
    if request.param == "gpu":
        why = drv.available()
        if why is not None:
            pytest.skip(f"the CUDA backend needs a GPU: {why}")
        yield "gpu"
        return
    why = emu_why_not()
    if why is not None:
        pytest.skip(f"the kernel emulator: {why}")
    import emu_driver
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("kernel_emu") if cache else tmp_path_factory.mktemp("kernel_emu")
    with pytest.MonkeyPatch.context() as mp:
        emu_driver.install(mp, folder)
        yield "emu"


TOL = 1e-3
POLL_S = 60.0


@pytest.mark.parametrize("batched", [True, False])
def test_copy_batch(device, batched, monkeypatch):
    """Host-to-device copies of pinned memory in one cuMemcpyBatchAsync (the streamed experts' path), and one call
    a copy where the driver lacks it: every byte where its own copy put it. The probe finds the batch call on
    this rig (a GPU machine whose driver or bindings lacked it would fail here, not fall back unseen)."""
    from strata.cuda.driver import check, cu
    dev = drv.Device.open()
    assert drv.CopyBatch.probe(), drv.CopyBatch.why
    if not batched:
        monkeypatch.setattr(drv.CopyBatch, "ok", False)
    sizes = [4096, 1, 300, 65536, 777]
    host = drv.HostBuffer(sum(sizes), what="test")
    src = host.array(np.uint8, (sum(sizes),))
    src[:] = np.random.default_rng(1).integers(0, 256, src.size, dtype=np.uint8)
    total = 2 * sum(sizes)
    d = int(check(cu.cuMemAlloc(total), "cuMemAlloc"))
    stream = drv.Stream()
    try:
        check(cu.cuMemsetD8Async(d, 0, total, stream.handle), "cuMemsetD8Async")
        batch, at, out, want = drv.CopyBatch(stream), 0, total, np.zeros(total, np.uint8)
        for n in sizes:                  # each source slice to the far end of the destination, in reverse
            out -= n
            batch.add(d + out, host.ptr + at, n)
            want[out:out + n] = src[at:at + n]
            at += n
        assert len(batch) == len(sizes)
        batch.flush("test")
        assert len(batch) == 0
        stream.synchronize("test")
        back = np.empty(total, np.uint8)
        check(cu.cuMemcpyDtoH(back.ctypes.data, d, total), "cuMemcpyDtoH")
        assert np.array_equal(back, want)
        batch.add(d, host.ptr, 64)               # one destination twice (a slot loaded, evicted, loaded again):
        batch.add(d, host.ptr + 100, 64)         # the later copy's bytes stay, whatever order a batch runs in
        batch.flush("test")
        stream.synchronize("test")
        check(cu.cuMemcpyDtoH(back.ctypes.data, d, 64), "cuMemcpyDtoH")
        assert np.array_equal(back[:64], src[100:164])
        if device == "emu":              # a copy outside any allocation: the batch's error names it
            batch.add(d + total + (1 << 30), host.ptr, 16)
            with pytest.raises(drv.CudaError, match="test streamed 7, 16 B"):
                batch.flush("test streamed %d", 7)
            assert len(batch) == 0
    finally:
        check(cu.cuMemFree(d), "cuMemFree")
        stream.destroy()
        host.free()
        del dev


@pytest.fixture(scope="module", params=list(SPECS))
def case(request, tmp_path_factory):
    spec = SPECS[request.param]
    folder = tmp_path_factory.mktemp(f"cuda-{spec.name}")
    hf = build(spec, folder / "hf")
    tokens = sequence(spec, 4 * spec.budget + 20, seed=spec.seed)
    convert(folder / "hf", folder / "model.gguf", "f32", log=lambda s: None)
    return spec, load_model(folder / "model.gguf"), tokens, hf_logits(hf, tokens)


def _wait(poll, what: str):
    t0 = time.monotonic()
    while (got := poll()) is None:
        if time.monotonic() - t0 > POLL_S:
            raise AssertionError(f"{what}: nothing after {POLL_S}s")
    return got


def run_protocol(be, model, tokens, cache=None, dump=None, whole=False) -> np.ndarray:
    """The scheduler's loop, one-row steps: begin, per layer pre -> doorbell -> host experts (an ExpertPlan) ->
    post, then the head. `cache(layer, experts)` runs between the route and the post (the host's cache policy
    loading experts)."""
    cfg, W = model.cfg, model.weights
    seq = be.new_seq(dump)
    window = NgramWindow.start(cfg) if cfg.ple_layers else None
    out = []
    try:
        for pos, t in enumerate(tokens):
            step = Step((Segment(seq, (t,), pos),))
            ple_e = ple_gather(W.per_layer_token_embd, ple_rows(cfg, [t], window)) if window else None
            if whole:
                be.launch_whole(step, ple_e)
            else:
                be.begin(step)
                if ple_e is not None:
                    be.stage_ple(ple_e)
                _layers(be, model, cache)
            out.append(_wait(be.poll_logits, "logits")[0])
            if window is not None:
                window.advance(cfg, t)
    finally:
        be.free_seq(seq)
    return np.stack(out)


def _layers(be, model, cache, rows: int | None = None) -> None:
    """A begun step's layers as the scheduler runs them (pre -> doorbell -> the host's experts for the routes the
    backend does not hold -> post), then the head. `cache(layer, experts)` runs between the route and the post;
    rows: the step's row count, checked against each route."""
    cfg, W = model.cfg, model.weights
    k, E = cfg.n_expert_used, cfg.n_embd
    for il in range(cfg.n_layer):
        be.launch_pre(il)
        r = _wait(lambda: be.poll_route(il), f"route of layer {il}")
        if rows is not None:
            assert r.ids.shape == (rows, k)
        plan = ExpertPlan.of(il, r.ids, E)
        if cache is not None:
            cache(il, plan.experts)
        plan.resident = be.resident(il, plan.experts)
        flat = plan.parts.reshape(-1, E)
        for u in np.flatnonzero(~plan.resident):
            p = plan.pairs[plan.offsets[u]:plan.offsets[u + 1]]
            flat[p] = expert_ffn(*W.layers[il].expert(int(plan.experts[u])), r.x[p // k])
        be.launch_post(plan)
    be.launch_head()


def _round_robin_cache(be, model):
    """A host cache policy for run_protocol / run_steps: after each route, up to 2 of the layer's missing experts
    into the next slots round robin (the cache's own: the lent ones are a step of several rows' while it runs, and
    only the scheduler hands them back and forth). Returns it and [hits, routed] counted over its calls."""
    W, n_slots, nxt, hits = model.weights, be.n_slots, [0], [0, 0]

    def cache(il, ids):
        mask = be.resident(il, ids)
        hits[0] += int(mask.sum())
        hits[1] += len(ids)
        for e in [int(e) for e, m in zip(ids, mask) if not m][:2]:
            be.load_expert(il, e, nxt[0], *(m.raw for m in W.layers[il].expert(e)))
            nxt[0] = (nxt[0] + 1) % n_slots
    return cache, hits


def _check(name, out, ref):
    err = rel_err(out, ref)
    print(f"{name}: max rel err {err.max():.2e} at position {err.argmax()} of {len(err)}")
    assert out.shape == ref.shape
    assert err.max() <= TOL, f"{name}: max rel err {err.max():.2e} at position {err.argmax()}"


def test_vram_logits_match_transformers(case):
    spec, model, tokens, ref = case
    be = CudaBackend(model, experts="vram", max_ctx=128, log=print)
    try:
        _check(f"{spec.name} vram", run_protocol(be, model, tokens), ref)
    finally:
        be.close()


def test_host_experts_all_misses(case):
    spec, model, tokens, ref = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for the host path (the kernels are shared)")
    be = CudaBackend(model, experts="host", max_ctx=128, log=print)
    try:
        assert be.expert_slots() == 0
        _check(f"{spec.name} host", run_protocol(be, model, tokens), ref)
    finally:
        be.close()


def test_partial_cache(case):
    """A few slots, filled round-robin by the host between the route and the post of the same layer: some of the
    layer's experts become resident while it runs (post waits for their copies), evicted ones go back to the host."""
    spec, model, tokens, ref = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for the cache path")
    probe = CudaBackend(model, experts="host", max_ctx=128, log=print)
    budget = probe.A.total + 6 * probe.slot_bytes + (1 << 20)
    probe.close()
    be = CudaBackend(model, experts="host", vram_budget_bytes=budget, max_ctx=128, log=print)
    n_slots = be.expert_slots()
    assert 0 < n_slots < model.cfg.n_layer * model.cfg.n_expert
    cache, hits = _round_robin_cache(be, model)
    try:
        _check(f"{spec.name} cache({n_slots} slots)", run_protocol(be, model, tokens, cache=cache), ref)
        print(f"cache hits {hits[0]} of {hits[1]} routed experts")
        assert 0 < hits[0] < hits[1]
    finally:
        be.close()


def test_budget_counts_the_device(case):
    """budget_counts_device (what the engine passes): the budget bounds the device memory in use, the CUDA context
    and what else the GPU holds included; a budget that the context alone exhausts is refused with the reason."""
    from strata.cuda.backend import MEM_MARGIN, BackendError
    spec, model, tokens, ref = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for the budget arithmetic")
    probe = CudaBackend(model, experts="host", max_ctx=128, log=print)
    free, total = probe.dev.mem_info()
    held, need, slot = total - free - probe.A.total, probe.A.total, probe.slot_bytes
    probe.close()
    with pytest.raises(BackendError, match="already in use on the device"):
        CudaBackend(model, experts="host", vram_budget_bytes=held + MEM_MARGIN, max_ctx=128,
                    budget_counts_device=True, log=print)
    budget = held + MEM_MARGIN + need + 6 * slot + (64 << 20)     # 64 MiB: the context's own growth between opens
    be = CudaBackend(model, experts="host", vram_budget_bytes=budget, max_ctx=128, budget_counts_device=True,
                     log=print)
    try:
        assert be.expert_slots() > 0
        assert be.device_in_use <= budget, (be.device_in_use, budget)
        _check(f"{spec.name} counted budget", run_protocol(be, model, tokens), ref)
    finally:
        be.close()


@pytest.mark.parametrize("mode", ["vram", "host-cache"])
def test_scheduler_over_cuda(case, mode):
    """The real token loop (strata.host.scheduler) over the CUDA backend: with every expert in VRAM it runs the
    whole-token graph; with a small cache its misses go to the CPU pool and to uploads straight from the pinned
    blobs the backend allocated (CudaBackend.host_alloc). Logits against transformers, every position."""
    import asyncio

    from strata.host.scheduler import HostConfig, Scheduler
    spec, model, tokens, ref = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for the scheduler's paths")
    if mode == "vram":
        be = CudaBackend(model, experts="vram", max_ctx=128, log=print)
    else:
        probe = CudaBackend(model, experts="host", max_ctx=128, log=print)
        budget = probe.A.total + 8 * probe.slot_bytes + (1 << 20)
        probe.close()
        be = CudaBackend(model, experts="host", vram_budget_bytes=budget, max_ctx=128, log=print)

    async def go():
        sched = Scheduler(model, be, HostConfig(vram_budget_bytes=1 << 40))
        try:                                   # aclose closes the backend too
            out = await sched.score(tokens)
            stats = (sched.whole, sched.cache.uploads, sched.cache.hit_rate(),
                     be.cells.nbytes if mode != "vram" else 0)
            return out, stats
        finally:
            await sched.aclose()
    out, (whole, uploads, hit_rate, pinned) = asyncio.run(go())
    _check(f"{spec.name} scheduler {mode}", np.asarray(out), ref)
    if mode == "vram":
        assert whole
    else:
        print(f"uploads {uploads}, hit rate {hit_rate:.2f}, pinned blob cells {pinned / 2**20:.1f} MiB")
        assert not whole and uploads > 0
        assert pinned > 0, "no blob came from the backend's pinned cells"


def test_stage_dump_matches_reference(case):
    """The C1 oracle: every stage of every layer against the numpy reference's dump (bisects a failure)."""
    spec, model, tokens, _ = case
    toks = tokens[:2 * spec.budget]
    ours = StageDump()
    be = CudaBackend(model, experts="vram", max_ctx=128, log=print)
    try:
        run_protocol(be, model, toks, dump=ours)
    finally:
        be.close()
    ref = StageDump()
    rm = RefModel(model.weights)
    rm.chunk(rm.new_state(ref), toks)
    assert len(set(ours.data) & set(ref.data)) >= len(toks) * model.cfg.n_layer * 8
    assert first_divergence(ours, ref, rtol=1e-4) is None, f"first divergence: {first_divergence(ours, ref, 1e-4)}"


def test_replay_equals_eager_bitwise(case, device):
    """64 steps: captured graphs replayed == the same kernels launched one by one, bit for bit; the whole-token
    graph == the per-layer graphs. Then the doorbell's launch-to-host-seen latency."""
    spec, model, tokens, _ = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for the bitwise replay check")
    toks = (tokens * 2)[:64]
    graphs = CudaBackend(model, experts="vram", max_ctx=128, graphs=True, log=print)
    try:
        replayed = run_protocol(graphs, model, toks)
        whole = run_protocol(graphs, model, toks, whole=True)
        lat = graphs.measure_doorbell(200) * 1e6
        print(f"doorbell launch-to-host-seen: median {np.median(lat):.1f} us, p90 {np.percentile(lat, 90):.1f} us "
              f"({len(lat)} rings)")
    finally:
        graphs.close()
    eager = CudaBackend(model, experts="vram", max_ctx=128, graphs=False, log=print)
    try:
        direct = run_protocol(eager, model, toks)
    finally:
        eager.close()
    assert np.array_equal(replayed, direct), f"replay differs from eager at {np.argwhere(replayed != direct)[:3]}"
    assert np.array_equal(whole, replayed), "the whole-token graph differs from the per-layer graphs"
    if device == "gpu":                  # the emulator's kernels run at the launch: its latency is theirs
        assert np.median(lat) < 200.0


# ---- batched steps (step_tokens > 1): a prompt chunk of T rows per step -------------------------------------

def chunk_sizes(n: int, seed: int, big: int = 0) -> list[int]:
    """A seeded schedule of chunk sizes 1..9 (and some of `big` rows) covering n tokens."""
    rng = np.random.default_rng(seed)
    out, left = [], n
    while left:
        c = int(rng.integers(1, 10)) if not big or rng.random() < 0.6 else big
        out.append(min(c, left))
        left -= out[-1]
    return out


def run_steps(be, model, tokens, sizes, cache=None, whole=False) -> np.ndarray:
    """The scheduler's loop over steps of the given sizes, every row's logits ("all"); misses computed on the host
    (the numpy expert) for the rows that route to them, as the CPU pool does. whole: each step as the backend's
    whole-step graph (experts='vram')."""
    cfg, W = model.cfg, model.weights
    seq = be.new_seq()
    window = NgramWindow.start(cfg) if cfg.ple_layers else None
    out, pos = [], 0
    try:
        for n in sizes:
            toks = tuple(int(t) for t in tokens[pos:pos + n])
            step = Step((Segment(seq, toks, pos, logits="all"),))
            e = ple_gather(W.per_layer_token_embd, ple_rows(cfg, toks, window)) if window is not None else None
            if window is not None:
                window.advance_all(cfg, toks)
            if whole:
                be.launch_whole(step, e)
            else:
                be.begin(step)
                if e is not None:
                    be.stage_ple(e)
                _layers(be, model, cache, rows=n)
            got = _wait(be.poll_logits, "logits")
            assert got.shape == (n, cfg.n_vocab)
            out.append(got)
            pos += n
    finally:
        be.free_seq(seq)
    return np.concatenate(out)


def _numpy_rows(model, tokens) -> np.ndarray:
    """Every position's logits from the numpy reference in float32, one token a step."""
    rm = RefModel(model.weights)
    st = rm.new_state()
    return np.stack([rm.step(st, int(t)) for t in tokens])


def test_batched_equals_one_row_and_transformers(case):
    """Chunks of 1..9 rows and of 40 (crossing QSA blocks and the budget, EOS inside): every row within 1e-5 of
    the one-row CUDA path and within 1e-4 of transformers; graphs replayed == eager launches bit for bit."""
    spec, model, tokens, ref = case
    one = CudaBackend(model, experts="vram", max_ctx=128, log=print)
    try:
        single = run_protocol(one, model, tokens)
    finally:
        one.close()
    sizes = chunk_sizes(len(tokens), spec.seed, big=40)
    be = CudaBackend(model, experts="vram", max_ctx=128, step_tokens=48, log=print)
    try:
        batched = run_steps(be, model, tokens, sizes)
        whole = run_steps(be, model, tokens, sizes, whole=True)
    finally:
        be.close()
    assert np.array_equal(whole, batched), "the whole-step graph differs from the per-layer batched graphs"
    err = rel_err(batched, single)
    print(f"{spec.name}: batched vs one-row max rel err {err.max():.2e} (chunks {sizes[:12]}...)")
    worst = np.argsort(err)[-5:][::-1]
    print(f"  worst rows {worst.tolist()}: batched-one {err[worst]}, one-row vs transformers "
          f"{rel_err(single, ref)[worst]}, batched vs transformers {rel_err(batched, ref)[worst]}; one-row vs "
          f"transformers max {rel_err(single, ref).max():.2e}")
    # 1e-5 at every row, except where the model's function is ill-conditioned: there f32 reorderings alone move
    # rows past 1e-5 (the 8-layer "deep" geometry: the numpy reference in f32 is 3.0e-5 from transformers at row
    # 39, the one-row CUDA path up to 3.1e-5 on the H200; the batched path measured up to 2.7e-5 from the one-row
    # path there, 3.5e-5 on the emulator). A row may then differ from the one-row path by 4x the distance of an
    # independent f32 evaluation of it (the one-row path's, the numpy reference's) from transformers, or by the
    # largest such distance in the geometry: the noise floor of f32 in this function at that row
    noise = np.maximum(rel_err(single, ref), rel_err(_numpy_rows(model, tokens), ref))
    bound = np.maximum(1e-5, 4 * noise)
    if noise.max() > 1e-5:
        bound = np.maximum(bound, noise.max())
    print(f"  rows over 1e-5: {int((err > 1e-5).sum())} of {len(err)}")
    assert (err <= bound).all(), f"row {np.argmax(err / bound)}: {err[np.argmax(err / bound)]:.2e}"
    t_err = rel_err(batched, ref)
    print(f"{spec.name}: batched vs transformers max rel err {t_err.max():.2e}")
    assert t_err.max() <= 1e-4, f"row {t_err.argmax()}: {t_err.max():.2e}"
    if spec.name == "grouped":
        eager = CudaBackend(model, experts="vram", max_ctx=128, step_tokens=48, graphs=False, log=print)
        try:
            direct = run_steps(eager, model, tokens, sizes)
        finally:
            eager.close()
        assert np.array_equal(direct, batched), "batched graphs differ from their eager launches"


def test_batched_prepared_weights(case, device, monkeypatch, tmp_path_factory, request):
    """GEMM_WPREP (weights decoded and split once per launch, gemm.py WPREP) through the backend: steps of up to 48
    rows, the buckets of more than 16 rows with w_split launches and grouped CTAs, the 16-row bucket without; every
    row bit for bit what the tiles' own decode gives (jobs without planes; on the emulator a GEMM_WPREP=0 build made
    here), and within 1e-4 of transformers."""
    import os

    from strata.kernels import gemm as kgemm
    spec, model, tokens, ref = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for the prepared weights")
    sizes = chunk_sizes(len(tokens), spec.seed, big=40)
    monkeypatch.setattr(kgemm, "WPREP_MIN_ROWS", 17)

    def run():
        be = CudaBackend(model, experts="vram", max_ctx=128, step_tokens=48, log=print)
        try:
            assert be.batch.wprep == bool(kgemm.WPREP)
            return run_steps(be, model, tokens, sizes)
        finally:
            be.close()
    if not kgemm.WPREP:
        pytest.skip("this build has no prepared weights (GEMM_WPREP=0 in $STRATA_KERNEL_DEFINES)")
    prepared = run()
    monkeypatch.setattr(kgemm, "WPREP", 0)
    if device == "gpu":
        plain = run()
    else:
        import emu_driver
        monkeypatch.setenv("STRATA_KERNEL_DEFINES", os.environ.get("STRATA_KERNEL_DEFINES", "") + " GEMM_WPREP=0")
        cache = getattr(request.config, "cache", None)
        emu_driver.install(monkeypatch, cache.mkdir("kernel_emu") if cache else tmp_path_factory.mktemp("kernel_emu"))
        plain = run()
    assert np.array_equal(prepared, plain), "the prepared weights gave other numbers"
    assert rel_err(prepared, ref).max() <= 1e-4


def test_batched_split_k(case, monkeypatch):
    """Split-K GEMM launches (gemm.py k_slices) through the backend, made to apply to the tiny model's ops
    (KSPLIT_MIN_CHUNKS lowered to 1: its inputs are a few k-chunks long): steps of up to 48 rows with ops split in
    every bucket, each slice set added by its gemm_ksum launch; every row within 1e-5 of the unsplit build
    (GEMM_KSPLIT=0: another order of the same f32 sums) and within 1e-4 of transformers."""
    from strata.kernels import gemm as kgemm
    spec, model, tokens, ref = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for split-K")
    sizes = chunk_sizes(len(tokens), spec.seed, big=40)

    def run(split: int):
        monkeypatch.setattr(kgemm, "KSPLIT", split)
        monkeypatch.setattr(kgemm, "KSPLIT_MIN_CHUNKS", 1)
        be = CudaBackend(model, experts="vram", max_ctx=128, step_tokens=48, log=print)
        try:
            ksums = {b: [x.name for st in ls["pre"] + ls["post"] for _, xs in st for x in xs
                         if x.name.endswith(".ksum")] for b, ls in be.batch.launches.items()}
            assert all(ksums.values()) if split else not any(ksums.values()), ksums
            return run_steps(be, model, tokens, sizes)
        finally:
            be.close()
    split, plain = run(1), run(0)
    err = rel_err(split, plain)
    print(f"split-K vs unsplit: max rel err {err.max():.2e}")
    assert err.max() <= 1e-5
    assert rel_err(split, ref).max() <= 1e-4


def test_batched_narrow_apart(case, monkeypatch):
    """GEMM_NARROW_APART through the backend (strata/cuda/batch.py _gemms), made to apply to the tiny model's input
    projections (WIDE_OUT lowered to 100: its GDN qkv and QSA q are "wide", the rest narrow): each projection as a
    launch of the wide matrices in wider tiles and one of the narrow ones; every row bit for bit the one-launch
    projections, and within 1e-4 of transformers."""
    from strata.kernels import gemm as kgemm
    spec, model, tokens, ref = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for the projections' launches")
    sizes = chunk_sizes(len(tokens), spec.seed, big=40)
    monkeypatch.setattr(kgemm, "WIDE_OUT", 100)

    def run(apart: int):
        monkeypatch.setattr(kgemm, "NARROW_APART", apart)
        be = CudaBackend(model, experts="vram", max_ctx=128, step_tokens=48, log=print)
        try:
            names = [x.name for st in be.batch.launches[48]["pre"] for _, xs in st for x in xs]
            assert any(n.endswith("proj_narrow") for n in names) == bool(apart)
            return run_steps(be, model, tokens, sizes)
        finally:
            be.close()
    apart = run(1)
    assert np.array_equal(apart, run(0)), "the projections' narrow launches gave other numbers"
    assert rel_err(apart, ref).max() <= 1e-4


def test_batched_wide_expert_tiles(case, monkeypatch):
    """Expert tiles of 128 pairs (moe.py tile_plan; gate/up in gemm.cuh's paired GLU tile) through the backend, made
    to apply at steps of 48 rows (MOE_WIDE_PAIRS lowered to the 18 pairs an expert they have), alone and with each
    expert's last <= 64 pairs in 64-pair tiles (MOE_NARROW_LAST, every tile here): every row bit for bit what
    64-pair tiles give, and within 1e-4 of transformers. (tests/test_cuda_kernels.py test_grouped_experts mixes
    the two lists in one step.)"""
    from strata.kernels import moe as kmoe
    spec, model, tokens, ref = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for the expert tiles")
    sizes = chunk_sizes(len(tokens), spec.seed, big=40)

    def run(wide: int, narrow_last: int):
        monkeypatch.setattr(kmoe, "WIDE_PAIRS", wide)
        monkeypatch.setattr(kmoe, "NARROW_LAST", narrow_last)
        be = CudaBackend(model, experts="vram", max_ctx=128, step_tokens=48, log=print)
        try:
            tp = be.batch.tile_plan
            assert (tp.bn, tp.bn2) == ((128, 64 if narrow_last else 0) if wide < 64 else (64, 0))
            return run_steps(be, model, tokens, sizes)
        finally:
            be.close()
    narrow = run(64, 1)
    for wide, last in ((48 * 3 // 8, 0), (48 * 3 // 8, 1)):
        got = run(wide, last)
        assert np.array_equal(got, narrow), f"128-pair expert tiles (narrow last {last}) gave other numbers"
    assert rel_err(narrow, ref).max() <= 1e-4


def test_batched_host_cache(case):
    """Batched steps with experts on the host and a few cache slots filled between route and post: the resident
    experts' rows on the GPU, the others' parts from the host; every row against transformers."""
    spec, model, tokens, ref = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for the batched cache path")
    probe = CudaBackend(model, experts="host", max_ctx=128, step_tokens=32, log=print)
    budget = probe.A.total + 6 * probe.slot_bytes + (1 << 20)
    probe.close()
    be = CudaBackend(model, experts="host", vram_budget_bytes=budget, max_ctx=128, step_tokens=32, log=print)
    n_slots = be.expert_slots()
    cache, hits = _round_robin_cache(be, model)
    try:
        out = run_steps(be, model, tokens, chunk_sizes(len(tokens), 3, big=32), cache=cache)
    finally:
        be.close()
    _check(f"{spec.name} batched cache({n_slots} slots)", out, ref)
    assert rel_err(out, ref).max() <= 1e-4
    assert 0 < hits[0] < hits[1]


def test_scheduler_batched_prefill(case):
    """The scheduler over a batched CUDA backend: a prompt in chunks of step_tokens (the vram mode's per-layer
    path for chunks, the whole-token graph for one-row steps), logits of every position against transformers."""
    import asyncio

    from strata.host.scheduler import HostConfig, Scheduler
    spec, model, tokens, ref = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for the scheduler")
    be = CudaBackend(model, experts="vram", max_ctx=128, step_tokens=24, log=print)

    async def go():
        sched = Scheduler(model, be, HostConfig(vram_budget_bytes=1 << 40, step_tokens=24))
        try:
            return await sched.score(tokens)
        finally:
            await sched.aclose()
    out = np.asarray(asyncio.run(go()))
    _check(f"{spec.name} scheduler batched", out, ref)


async def _mapped_chunks_mapped(sched, be, tokens, chunk: int):
    """Every blob held (one-row steps run mapped), then: 6 mapped tokens (promotions fill the cache), the whole
    sequence afresh in chunks of `chunk` rows, the 6 mapped tokens again (promotions refill what the chunks took).
    Returns their logits and the backend's slot map after the first tokens and after the chunks."""
    import asyncio
    cfg = sched.cfg
    for il in range(cfg.n_layer):
        for e in range(cfg.n_expert):
            await asyncio.wrap_future(sched.store.fetch(il, e))
    head = await sched.score(tokens[:6])
    cached = dict(be._slot_of)
    sched.step_tokens = sched.logit_rows = chunk
    rest = await sched.score(tokens)
    after = dict(be._slot_of)
    sched.step_tokens = sched.logit_rows = 1
    again = await sched.score(tokens[:6])
    return head, rest, again, cached, after


def test_scheduler_streamed_prefill(case, monkeypatch):
    """Experts on the host, prompt chunks streamed (stream_experts="always"): every expert a layer lacks copied into
    the stream buffers (or free cache slots) while the layer before runs, the cache's experts (filled by mapped
    one-row steps first) used in place and kept, but for those in the stream buffers, which the cache holds between
    streamed steps (lent_slots): the step takes them back first and streams their experts like any other lacking
    one; every position against transformers, and against the split path (CPU pool and uploads) within 1e-5; the
    device timed every layer's copies and compute; the routes copied back per layer (the counts' input, read after
    the step) are those the split path's doorbells gave; mapped tokens after the prompt, with the stream buffers
    the cache's again, give the first ones' logits bit for bit."""
    import asyncio

    from strata.host.scheduler import HostConfig, Scheduler
    spec, model, tokens, ref = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for streamed steps")
    cfg = model.cfg
    probe = CudaBackend(model, experts="host", max_ctx=128, step_tokens=24, log=print)
    # room for the two stream buffers and a cache of 2 n_expert + 2 slots: the buffers lend it the rest
    budget = probe.A.total + (4 * cfg.n_expert + 2) * probe.slot_bytes + (1 << 20)
    probe.close()

    def run(mode: str):
        be = CudaBackend(model, experts="host", vram_budget_bytes=budget, max_ctx=128, step_tokens=24, log=print)
        n_all = cfg.n_layer * cfg.n_expert
        assert be.stream_slots() == cfg.n_expert and 6 <= be.n_slots < n_all
        assert be.lent_slots() - be.n_lend_act == min(2 * cfg.n_expert, n_all - be.n_slots) > 0
        assert be.expert_slots() == be.n_slots + be.lent_slots()
        opened, times, routes = [], [], []
        real_open, real_times = be.stream_open, be.stream_times
        real_routes, real_poll = be.streamed_routes, be.poll_route
        be.stream_open = lambda layer: (opened.append(layer), real_open(layer))[1]
        be.stream_times = lambda: times.append(real_times()) or times[-1]
        be.streamed_routes = lambda: routes.append(real_routes().copy()) or routes[-1]

        def poll_route(layer):                  # the split path's routes of the 24-row chunks, layer by layer
            r = real_poll(layer)
            if r is not None and be.cur.T > 1:
                if layer == 0:
                    routes.append([])
                routes[-1].append(r.ids.copy())
            return r
        be.poll_route = poll_route

        async def go():
            sched = Scheduler(model, be, HostConfig(vram_budget_bytes=budget, step_tokens=1, stream_experts=mode,
                                                    map_experts="always"))
            try:
                head, rest, again, cached, after = await _mapped_chunks_mapped(sched, be, tokens, 24)
                refilled = any(s >= be.n_slots for s in be._slot_of.values())
                return head, rest, again, cached, after, refilled
            finally:
                await sched.aclose()
        head, rest, again, cached, after, refilled = asyncio.run(go())   # aclose closes the backend
        assert any(s >= be.n_slots for s in cached.values()), "no promotion reached the lent stream buffers"
        assert np.array_equal(np.asarray(again), np.asarray(head)) and refilled
        core = {k: s for k, s in cached.items() if s < be.n_slots}
        if mode == "always":                  # a streamed prompt evicts only what it took back (it may fill free
            assert core.items() <= after.items()                  # slots) and leaves its buffers empty
            assert not any(s >= be.n_slots for s in after.values())
        return np.asarray(rest), opened, times, core, [np.asarray(r) for r in routes]
    batches = []                          # the streamed copies go as batches, one driver call a stream_experts
    real_enqueue = drv.CopyBatch._enqueue
    monkeypatch.setattr(drv.CopyBatch, "_enqueue",
                        staticmethod(lambda d, s, n, stream: (batches.append(len(n)), real_enqueue(d, s, n, stream))))
    streamed, opened, times, cached, routes = run("always")
    split, opened_split, _, _, split_routes = run("never")
    assert len(routes) == len(split_routes) == len(times) > 0
    for got, want in zip(routes, split_routes):
        assert np.array_equal(got, want)
    _check(f"{spec.name} streamed prefill", streamed, ref)
    assert rel_err(streamed, ref).max() <= 1e-4
    assert rel_err(streamed, split).max() <= 1e-5
    assert cached and not opened_split and len(opened) == cfg.n_layer * len(times)
    for t in times:
        assert [x[0] for x in t] == list(range(cfg.n_layer))
        assert all(x[1] <= cfg.n_expert - sum(1 for (l, _) in cached if l == x[0]) for x in t)
        assert all(x[3] > 0 for x in t if x[1])
        assert all(x[5] > 0 and x[6] > 0 for x in t)                 # pre and post timed on the device
    assert sum(x[1] for x in times[0]) > 0
    assert drv.CopyBatch.ok, drv.CopyBatch.why
    assert sum(batches) >= sum(x[1] for t in times for x in t) and len(batches) < sum(batches)


@pytest.mark.parametrize("experts", ["vram", "host"])
def test_batched_step_writes_only_what_it_takes_back(case, experts):
    """A step of few rows takes back only the activations' slots its bucket touches (BatchPath.touched): so it must
    write nothing else. Every byte of the section outside a 16-row bucket's ranges set to a pattern, a 10-row step
    (and a 1-row step after it; experts in VRAM, or on the host with their parts copied in) leave them as they
    were, and its logits match transformers; the slots taken back for the small bucket are fewer than for the
    largest, and every slot it leaves lent lies outside its ranges."""
    from strata.cuda.arena import DevArray
    spec, model, tokens, ref = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for the activations' ranges")
    be = CudaBackend(model, experts=experts, max_ctx=512, step_tokens=512, log=print)
    try:
        act, bp = be.batch.act, be.batch
        assert bp.bucket(10) == 16 and bp.buckets[-1] == 512
        r16, r512 = bp.touched(16), bp.touched(512)
        outside = np.ones(act.total, bool)
        for a, b in r16:
            outside[a:min(b, act.total)] = False
        assert outside.sum() > act.total // 4                # the rows past 128 of every buffer of rows
        assert (r16[:, 1] - r16[:, 0]).sum() < (r512[:, 1] - r512[:, 0]).sum()
        slot = 4096                                       # slots of this size lent from the section:
        n = act.total // slot
        ids16, ids512 = bp.touched_slots(16, slot, n), bp.touched_slots(512, slot, n)
        assert len(ids16) < len(ids512) == n and set(ids16.tolist()) < set(ids512.tolist())
        kept = np.ones(act.total, bool)                   # those a 16-row step leaves to the cache
        for i in ids16.tolist():
            kept[i * slot:(i + 1) * slot] = False
        kept[n * slot:] = False
        assert kept.any() and not (kept & ~outside).any()
        section = DevArray(be.A, "activations", act.offset, (act.total,), np.dtype(np.uint8))
        before = section.download()
        before[outside] = 0xA5
        section.upload(before)
        out = run_steps(be, model, tokens, [10, 1])
        after = section.download()
        bad = np.flatnonzero(outside & (after != before))
        where = sorted({a.name for a in be.A.items if a.section is act for i in bad[:1000:50].tolist()
                        if a.offset <= i < a.offset + a.nbytes + 32})
        assert not len(bad), f"{len(bad)} bytes written outside the 16-row bucket's ranges, in {where}"
        _check(f"{spec.name} {experts} 10 rows then 1", out, ref[:11])
    finally:
        be.close()


def test_scheduler_lent_activations(case):
    """Experts on the host, a cache too small for stream buffers: the batched step's activations (the slots after
    the cache's own, in the same buffer) are the cache's between steps of several rows. Mapped one-row steps
    promote experts into them; a split chunk (stream_experts="never") takes back those its rows touch (their
    experts leave the cache, the others' stay, nothing is loaded into them while it runs), finds those that held
    experts zeroed, and gives every position as transformers does; mapped tokens after it refill them and give
    the first tokens' logits bit for bit; a batched step begun while experts sit in them is refused."""
    import asyncio

    from strata.cuda.arena import DevArray
    from strata.host.backend import BackendError
    from strata.host.scheduler import HostConfig, Scheduler
    spec, model, tokens, ref = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for the lent activations")
    cfg = model.cfg
    probe = CudaBackend(model, experts="host", max_ctx=128, step_tokens=8, log=print)
    budget = probe.A.total + (1 << 20) + 2 * probe.slot_bytes     # ~3 slots of the 32 experts
    probe.close()
    be = CudaBackend(model, experts="host", vram_budget_bytes=budget, max_ctx=128, step_tokens=8, log=print)
    act = be.batch.act
    print(f"{be.n_slots} slots, {be.n_lend_act} lent from the activations' {act.total} bytes")
    assert be.n_stream == 0 and be.lent_slots() == be.n_lend_act > 0 and 0 < be.n_slots
    assert be.n_slots + be.n_lend_act < cfg.n_layer * cfg.n_expert
    section = DevArray(be.A, "activations", act.offset, (act.total,), np.dtype(np.uint8))
    takes = []
    real_take = be.take_lent

    def take(stream, rows):
        held = {k: s for k, s in be._slot_of.items() if s >= be.n_slots}
        ids = real_take(stream, rows)
        be.stream.synchronize("test")
        b = section.download()
        rel = ids - be.n_slots
        zeroed = all(not b[i * be.slot_bytes:(i + 1) * be.slot_bytes].any() for i in rel.tolist())
        takes.append((ids.tolist(), {k: s for k, s in held.items() if s in set(ids.tolist())}, zeroed))
        assert not set(ids.tolist()) & set(be._slot_of.values())
        assert {k: s for k, s in held.items() if s not in set(ids.tolist())}.items() <= be._slot_of.items()
        return ids
    be.take_lent = take

    async def go():
        sched = Scheduler(model, be, HostConfig(vram_budget_bytes=budget, step_tokens=1, stream_experts="never",
                                                map_experts="always"))
        try:
            head, rest, again, cached, after = await _mapped_chunks_mapped(sched, be, tokens, 8)
            refilled = dict(be._slot_of)
            seq = be.new_seq()
            try:
                with pytest.raises(BackendError, match="take_lent first"):
                    be.begin(Step((Segment(seq, tuple(int(t) for t in tokens[:8]), 0, logits="all"),)))
            finally:
                be.free_seq(seq)
            return head, rest, again, cached, after, refilled, dict(sched.cache._lru)
        finally:
            await sched.aclose()
    head, rest, again, cached, after, refilled, lru = asyncio.run(go())
    assert any(s >= be.n_slots for s in cached.values()), "no promotion reached the lent activations"
    assert takes and takes[0][0] == be._act_ids[8].tolist() and takes[0][1]
    assert all(zeroed for _, held, zeroed in takes if held)     # the later chunks find the one before's rows
    assert not any(s >= be.n_slots for s in after.values()), "a chunk left experts in its activations' slots"
    assert any(s >= be.n_slots for s in refilled.values())
    assert set(lru) == set(refilled)
    _check(f"{spec.name} lent activations", np.asarray(rest), ref)
    assert np.array_equal(np.asarray(again), np.asarray(head))


def test_scheduler_mapped_decode(case):
    """Experts on the host, all held in pinned memory, a few cache slots: every row a mapped token (one graph whose
    expert kernels read cache slots or, for misses, the blobs in host memory over PCIe; misses promoted while the
    next token runs). Every position against transformers, and against the per-layer split within 1e-5; tokens
    read experts both from slots and from host memory; the misses fetched first, fetched a layer early where
    predicted (prefetch, and with a prediction of k + 2 experts) and read in place give the same logits bit for
    bit; the wider prediction predicts every miss the narrow one did and more bytes."""
    import asyncio

    from strata.host.scheduler import HostConfig, Scheduler
    spec, model, tokens, ref = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for mapped tokens")
    cfg = model.cfg
    probe = CudaBackend(model, experts="host", max_ctx=128, log=print)
    budget = probe.A.total + (1 << 20) + 12 * probe.slot_bytes         # 12 slots of the 32 experts
    stride = max(f.stride for f in probe.fetch_layouts)                 # a staged expert's room
    probe.close()

    timed = []
    slots = {}

    prefetched = []

    def run(mode: str, reads: str = "fetch", extra: int = 0):
        # a wider prediction's two stagings get their room on top: the same cache slots, so the same misses
        be = CudaBackend(model, experts="host", vram_budget_bytes=budget + 2 * extra * stride, max_ctx=128,
                         mapped_reads=reads, prefetch_extra=extra, log=print)
        slots[(reads, extra)] = be.expert_slots()
        assert be.can_map and 0 < be.expert_slots() < cfg.n_layer * cfg.n_expert
        assert be.prefetch == (reads == "prefetch")
        assert not be.prefetch or be.pred_all.shape == (cfg.n_layer, cfg.n_expert_used + extra)
        seen = []
        real, real_t, real_p = be.token_routes, be.mapped_timing, be.token_prefetch
        be.token_routes = lambda: seen.append(real()) or seen[-1]
        be.mapped_timing = lambda: timed.append(real_t()) or timed[-1]
        be.token_prefetch = lambda: prefetched.append(real_p()) or prefetched[-1]

        async def go():
            sched = Scheduler(model, be, HostConfig(vram_budget_bytes=budget, step_tokens=1, map_experts=mode))
            try:
                for il in range(cfg.n_layer):
                    for e in range(cfg.n_expert):
                        await asyncio.wrap_future(sched.store.fetch(il, e))
                return await sched.score(tokens)
            finally:
                await sched.aclose()
        out = asyncio.run(go())
        return np.asarray(out), seen, be.mapped
    mapped, seen, was_mapped = run("always")
    assert len(timed) == len(tokens) and all(t["graph_ms"] > 0 and t["table_ms"] >= 0 for t in timed)
    assert any(t["promoted"] is not None and t["promoted"][0] > 0 and t["promoted"][2] > 0 for t in timed)
    direct, _, _ = run("always", "direct")
    assert all(p is None for p in prefetched)
    pre, _, _ = run("always", "prefetch")
    stats = np.array([p for p in prefetched if p is not None])      # (misses, predicted, prefetched, bytes)
    assert len(stats) == len(tokens) and (stats[:, 1] <= stats[:, 0]).all()
    assert stats[:, 1].sum() > 0 and stats[:, 2].sum() > 0 and stats[:, 3].sum() > 0
    prefetched.clear()
    wide, _, _ = run("always", "prefetch", extra=2)
    wide_stats = np.array([p for p in prefetched if p is not None])
    assert slots[("prefetch", 2)] == slots[("prefetch", 0)]
    assert (wide_stats[:, 0] == stats[:, 0]).all()                  # the same routes and slots: the same misses
    assert (wide_stats[:, 1] >= stats[:, 1]).all() and (wide_stats[:, 3] >= stats[:, 3]).all()
    split, seen_split, _ = run("never")
    _check(f"{spec.name} mapped decode", mapped, ref)
    assert was_mapped and len(seen) == len(tokens) and not seen_split
    assert rel_err(mapped, ref).max() <= 1e-4
    assert rel_err(mapped, split).max() <= 1e-5
    assert (mapped == direct).all(), "misses fetched into VRAM and read over PCIe gave different logits"
    assert (mapped == pre).all(), "misses prefetched a layer early gave different logits"
    assert (mapped == wide).all(), "misses prefetched by a wider prediction gave different logits"
    res = np.stack([r for _, r in seen])
    assert res.any() and not res.all()


def test_mapped_prefetch_graph_joins(case, monkeypatch):
    """The mapped token's graph with mapped_reads="prefetch", read from its capture order: layer l's fetch waits
    for layer l's prefetch and not for layer l + 1's (forked before it, in layer l's pre: a wait on that record
    would run every prefetch serially, which the logits cannot show), and layer l's ffn read waits for layer l's
    prediction."""
    from strata.cuda import launch as L
    spec, model, _, _ = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for mapped tokens")
    probe = CudaBackend(model, experts="host", max_ctx=64, log=print)
    budget = probe.A.total + (1 << 20) + 12 * probe.slot_bytes
    probe.close()
    be = CudaBackend(model, experts="host", vram_budget_bytes=budget, max_ctx=64, mapped_reads="prefetch", log=print)
    try:
        assert be.prefetch and be.can_map
        log: list[tuple] = []
        monkeypatch.setattr(L.Launch, "enqueue", lambda self, st: log.append(("launch", self.name, id(st))))
        monkeypatch.setattr(L.CopyH2D, "enqueue", lambda self, st: log.append(("copy", self.name, id(st))))
        monkeypatch.setattr(drv.Event, "record", lambda self, st: log.append(("record", id(self), id(st))))
        monkeypatch.setattr(drv.Stream, "wait", lambda self, ev: log.append(("wait", id(ev), id(self))))
        monkeypatch.setattr(drv, "memcpy_dtoh_async", lambda *a: None)
        be._enq_token()
    finally:
        be.close()
    main = id(be.stream)

    def waited_for(i: int) -> str:
        """The last launch on the recording stream before the record that the wait at log[i] resolves to."""
        ev = log[i][1]
        r = max(j for j in range(i) if log[j][0] == "record" and log[j][1] == ev)
        return next(log[j][1] for j in range(r - 1, -1, -1) if log[j][0] == "launch" and log[j][2] == log[r][2])

    n = model.cfg.n_layer
    for il in range(1, n):
        first = {kind: next(i for i, e in enumerate(log) if e[0] == "launch" and e[1] == f"blk.{il}.{kind}")
                 for kind in ("fetch", "ffn_down_inject")}
        for kind, want in (("fetch", f"blk.{il}.prefetch"), ("ffn_down_inject", f"blk.{il}.route_predicted")):
            i = first[kind]
            waits = [j for j in range(i) if log[j][0] == "wait" and log[j][2] == main]
            assert waits, f"layer {il}'s {kind} waits for nothing"
            assert waited_for(waits[-1]) == want, f"layer {il}'s {kind} waits for {waited_for(waits[-1])}"


def test_quantized_file_matches_reference(device, tmp_path_factory):
    """A file in the realistic type mix (`small` preset: Q2_0 experts, IQ4_XS, K-quants, BF16 router, Q8_0), whose
    formats the f32 parity models never reach: the CUDA backend's logits (one-row steps with every expert in VRAM,
    then one batched step of 12 rows, both through the scheduler) against the numpy reference on the same
    weights with f32 activations (load_model's exact: the CUDA kernels' contract; the default CPU path rounds the
    activations as llama.cpp does, ~1e-2 away), every position, within 1e-4."""
    import asyncio

    from strata.host.scheduler import HostConfig, Scheduler
    from strata.model.synth import make_model
    path = tmp_path_factory.mktemp("quantized") / "small.gguf"
    make_model("small", path, mix="realistic", log=lambda s: None)
    model = load_model(path, exact=True)
    tokens = [int(t) for t in np.random.default_rng(5).integers(0, model.cfg.n_vocab, 12)]
    rm = RefModel(model.weights)
    st = rm.new_state()
    ref = np.stack([rm.step(st, t) for t in tokens])

    def score(be, step_tokens=1):
        async def go():
            sched = Scheduler(model, be, HostConfig(vram_budget_bytes=1 << 40, step_tokens=step_tokens))
            try:
                return await sched.score(tokens)
            finally:
                await sched.aclose()
        return np.asarray(asyncio.run(go()))
    one = score(CudaBackend(model, experts="vram", max_ctx=64, log=print))
    batched = score(CudaBackend(model, experts="vram", max_ctx=64, step_tokens=12, log=print), 12)
    for name, out in (("one-row", one), ("batched", batched)):
        err = rel_err(out, ref)
        print(f"quantized {name} vs the reference: max rel err {err.max():.2e} at position {err.argmax()}")
        assert err.max() <= 1e-4


def test_prefix_reuse_over_cuda(case):
    """Prefix reuse on the GPU (snapshot / restore of the device state): a prompt, then the same prompt and 7 more
    tokens resumed from its snapshot; the resumed logits against a run with no snapshots (the chunking differs
    between the two runs, so one-row and batched rows may meet: within 1e-5, tokens equal)."""
    import asyncio

    from strata.engine import Engine, HostConfig
    from strata.sampling import SamplingParams
    spec, model, tokens, _ = case
    if spec.name != "grouped":
        pytest.skip("one geometry is enough for prefix reuse")
    a = list(map(int, tokens[:40]))
    turns = [a, a + list(map(int, tokens[40:47]))]

    async def run(budget):
        be = CudaBackend(model, experts="vram", max_ctx=128, step_tokens=16, log=print)
        seen, out = [], []
        orig = be.poll_logits

        def poll():
            got = orig()
            if got is not None:
                seen.append(got.copy())
            return got
        be.poll_logits = poll
        async with Engine(model, backend=be, host=HostConfig(prefix_cache_bytes=budget, step_tokens=16)) as e:
            for prompt in turns:
                seen.clear()
                toks = [c.token async for c in e.generate(prompt, SamplingParams(max_tokens=4, stop_at_eos=False))
                        if c.token is not None]
                out.append((toks, np.concatenate(seen)))
            hits = e.scheduler.prefixes.hits if budget else 0
        return out, hits
    got, hits = asyncio.run(run(1 << 30))
    want, _ = asyncio.run(run(0))
    assert hits == 1
    assert got[0][0] == want[0][0] and np.array_equal(got[0][1], want[0][1])     # the same run before any reuse
    gt, gl = got[1]
    wt, wl = want[1]
    assert gt == wt
    last = rel_err(gl[-len(gt):], wl[-len(wt):])            # the resumed prompt's last row and the decoded rows
    print(f"resumed vs recomputed: max rel err {last.max():.2e}")
    assert last.max() <= 1e-5
