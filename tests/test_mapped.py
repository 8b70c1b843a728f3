"""Mapped decode rows (HostConfig.map_experts): once the RAM tier holds every expert, a one-row step runs as one
graph whose expert kernels read each routed expert from its VRAM cache slot, or from its blob in host memory,
and the misses are promoted into the cache while the next token runs. On the CPU twin (CpuBackend with
cache_slots: slot copies, a load counted as the host's until the launch after it, the token's routes reported)
the logits equal the teacher-forced reference's exactly; the choice by measured cost; the trace's counts."""

from __future__ import annotations

import numpy as np
import pytest

from strata.engine import Engine
from strata.host.backend import MAPPED_READS, BackendError, CpuBackend
from strata.host.experts import ExpertLayout, VramCache
from strata.host.scheduler import MODE_RETRY, HostConfig, Scheduler, retry_interval
from strata.host.trace import Tracer, format_summary, load, summarize
from strata.model.loader import load_model
from test_scheduler import TOKENS, QueuedOnCpu, assert_parity, realistic_gguf  # noqa: F401  (its fixture)


class Spy(CpuBackend):
    """The cache twin, recording each mapped token's (ids, read-from-slot) and every load."""

    def __init__(self, model, slots: int):
        super().__init__(model, cache_slots=slots)
        self.tokens: list[tuple[np.ndarray, np.ndarray]] = []
        self.loads: list[tuple[int, int, int, int]] = []      # (launches so far, layer, expert, slot)

    def token_routes(self):
        got = super().token_routes()
        self.tokens.append(got)
        return got

    def load_expert(self, layer, expert, slot, gate, up, down):
        self.loads.append((self.launches, layer, expert, slot))
        super().load_expert(layer, expert, slot, gate, up, down)


def _mapped_rows(model, be, slots: int) -> Scheduler:
    """Every row a mapped token, under a budget of `slots` experts' blobs."""
    blob = ExpertLayout.from_model(model).blob_bytes(0)
    return Scheduler(model, be, HostConfig(step_tokens=1, vram_budget_bytes=slots * blob, map_experts="always"))


async def _preload(sched: Scheduler) -> None:
    import asyncio
    for il in range(sched.cfg.n_layer):
        for e in range(sched.cfg.n_expert):
            await asyncio.wrap_future(sched.store.fetch(il, e))


@pytest.mark.asyncio
@pytest.mark.parametrize("mix,exact", [("f32", False), ("realistic", False), ("realistic", True)])
async def test_mapped_tokens_keep_parity(mix, exact, tiny_gguf, realistic_gguf):
    """Every row a mapped token (map_experts="always"): exact logits at every position, experts read both from
    slots and from host memory, misses promoted, and a slot loaded after a launch is read from host memory by the
    next token (its copy is in flight), from its slot by the one after."""
    path = tiny_gguf if mix == "f32" else realistic_gguf
    model = load_model(path, exact=exact)
    blob = ExpertLayout.from_model(model).blob_bytes(0)
    be = Spy(model, 32)                                    # half of the 4 x 16 experts
    sched = Scheduler(model, be, HostConfig(step_tokens=1, vram_budget_bytes=32 * blob, map_experts="always"),
                      exact=exact)
    try:
        await _preload(sched)
        await assert_parity(sched, Engine.open_sync(path, exact=exact), TOKENS)
        assert len(be.tokens) == len(TOKENS) and be.launches == len(TOKENS)
        res = np.stack([r for _, r in be.tokens])
        assert res.any() and not res.all()                 # some from slots, some from host memory
        assert be.loads and len(sched.cache) == 32
        for at, layer, expert, slot in be.loads:           # loaded while token at - 1 ran: token at reads it
            if at >= len(be.tokens):                       # from host memory (its copy is in flight)
                continue
            ids, r = be.tokens[at]
            if expert in ids[layer]:
                assert not r[layer][list(ids[layer]).index(expert)]
        assert sched.pool.threads._work_queue.qsize() == 0 and sched.cache.uploads == len(be.loads)
    finally:
        await sched.aclose()


@pytest.mark.asyncio
async def test_promotions_go_as_one_batch(realistic_gguf):
    """A backend that queues load_expert's copies (as CUDA's do, one driver call a batch) gets each token's
    promotions sent by loads_done once they are all queued: no launch has to send them itself, and the logits
    stay exact (a queued slot holds 0xFF bytes until sent)."""
    model = load_model(realistic_gguf)
    be = QueuedOnCpu(model, 32)
    sched = _mapped_rows(model, be, 32)
    try:
        await _preload(sched)
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS)
        assert sched.cache.uploads > 0 and be.done_calls > 0 and be.left_at_launch == 0
    finally:
        await sched.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("cap", [0, 1])
async def test_promotions_per_layer_are_capped(cap, realistic_gguf):
    """HostConfig.promote_per_layer: after each mapped token at most `cap` of a layer's misses are loaded into the
    cache (0: none, the cache keeps what it had); the logits are the reference's all the same."""
    model = load_model(realistic_gguf)
    blob = ExpertLayout.from_model(model).blob_bytes(0)
    be = Spy(model, 32)
    sched = Scheduler(model, be, HostConfig(step_tokens=1, vram_budget_bytes=32 * blob, map_experts="always",
                                            promote_per_layer=cap))
    try:
        await _preload(sched)
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS)
        per = {}
        for at, layer, _, _ in be.loads:
            per[at, layer] = per.get((at, layer), 0) + 1
        assert max(per.values(), default=0) <= cap and (cap == 0) == (not be.loads)
        res = np.stack([r for _, r in be.tokens])
        assert not res.all()                               # misses were read from host memory
    finally:
        await sched.aclose()


@pytest.mark.asyncio
async def test_promotions_outrank_their_victims(realistic_gguf):
    """A mapped token's misses are promoted most popular first, each only over a less popular victim: every
    ranked placement into a full cache evicts the least recently used expert exactly when that one's decayed route
    count is below the newcomer's, refusals happen once the cache is full, and the logits are the reference's."""
    model = load_model(realistic_gguf)
    blob = ExpertLayout.from_model(model).blob_bytes(0)
    be = Spy(model, 24)
    sched = Scheduler(model, be, HostConfig(step_tokens=1, vram_budget_bytes=24 * blob, map_experts="always",
                                            cache_half_life=4))
    cache, place, calls = sched.cache, sched.cache.place, []

    def watched(layer, expert, nbytes, keep, evict=True, ranked=False):
        full = not cache._free
        victim = next((k for k in cache._lru if not (k[0] == layer and k[1] in keep)), None)
        mine, theirs = cache.score[layer, expert], cache.score[victim] if victim else None
        got = place(layer, expert, nbytes, keep, evict, ranked)
        if ranked and full and victim is not None:
            calls.append((mine, theirs, got, victim in cache._lru))
        return got
    cache.place = watched
    try:
        await _preload(sched)
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS)
        assert be.loads and calls
        for mine, theirs, got, kept in calls:
            assert (got is not None) == (mine > theirs) and kept == (got is None), (mine, theirs, got, kept)
        assert any(got is None for _, _, got, _ in calls) and any(got is not None for _, _, got, _ in calls)
    finally:
        await sched.aclose()


@pytest.mark.asyncio
async def test_mapped_waits_for_the_whole_store(realistic_gguf):
    """Until the RAM tier holds every expert, rows go layer by layer (the split); after the preload they map."""
    model = load_model(realistic_gguf)
    be = Spy(model, 8)
    blob = ExpertLayout.from_model(model).blob_bytes(0)
    sched = Scheduler(model, be, HostConfig(step_tokens=1, vram_budget_bytes=8 * blob, map_experts="always"))
    try:
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS[:4])
        assert be.launches == 0 and not be.mapped
        await _preload(sched)
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS[:6])
        assert be.launches == 6 and be.mapped
    finally:
        await sched.aclose()


@pytest.mark.asyncio
async def test_mapped_then_split_rows_read_the_same_cache(realistic_gguf):
    """Mapped rows fill the cache; rows forced to the split (map_experts="never" from then on) use those slots as
    VRAM hits (the twin computes them from its slot copies) and the logits stay exact."""
    model = load_model(realistic_gguf)
    be = Spy(model, 16)
    sched = _mapped_rows(model, be, 16)
    try:
        await _preload(sched)
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS[:8])
        hits0 = sum(sched.cache.hits.values())
        sched._can_map = False
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS)
        assert be.launches == 8 and sum(sched.cache.hits.values()) > hits0
    finally:
        await sched.aclose()


@pytest.mark.asyncio
async def test_auto_picks_the_cheaper_mode(realistic_gguf):
    """auto: the first mapped-eligible row maps, the next splits (each measured once), then the cheaper by the
    measured wall per token, the costlier re-measured every MODE_RETRY x (cost ratio) choices; a backend that cannot map is not
    asked again."""
    model = load_model(realistic_gguf)
    be = Spy(model, 8)
    sched = Scheduler(model, be, HostConfig(step_tokens=1, map_experts="auto"))
    try:
        await _preload(sched)
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS[:2])
        assert be.launches == 1 and set(sched._mode_cost[1]) == {"mapped", "split"}
        sched._mode_cost[1] = {"mapped": 2.0, "split": 1.0}
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS[:3])
        assert be.launches == 1
        sched._mode_cost[1] = {"mapped": 0.5, "split": 1.0}
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS[:3])
        assert be.launches == 4
        assert retry_interval(0.5, 1.0) == 2 * MODE_RETRY and retry_interval(1.0, 1.1) == MODE_RETRY
        sched._mode_picks[1] = retry_interval(0.5, 1.0) - 1     # the next choice re-measures the split
        sched._mode_cost[1] = {"mapped": 1e-9, "split": 2e-9}     # mapped stays the cheaper after the retry
        split0 = sched.decode_modes["split"]
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS[:2])
        assert be.launches == 5 and sched.decode_modes["split"] == split0 + 1
        assert sched._mode_cost[1]["split"] > 1e-6      # the retry's measurement replaced the stale one
    finally:
        await sched.aclose()

    class NoMap(Spy):
        def map_experts(self, blobs):
            self.asked = getattr(self, "asked", 0) + 1
            return False
    be = NoMap(model, 8)
    sched = Scheduler(model, be, HostConfig(step_tokens=1, map_experts="always"))
    try:
        await _preload(sched)
        await assert_parity(sched, Engine.open_sync(realistic_gguf), TOKENS[:4])
        assert be.asked == 1 and be.launches == 0
    finally:
        await sched.aclose()


@pytest.mark.asyncio
async def test_mapped_trace(realistic_gguf, tmp_path):
    """The trace marks mapped steps, counts each layer's VRAM hits and the misses read in place with their bytes,
    and the summary's parts still sum to the wall."""
    model = load_model(realistic_gguf)
    layout = ExpertLayout.from_model(model)
    be = Spy(model, 8)
    path = tmp_path / "t.jsonl"
    sched = Scheduler(model, be, HostConfig(step_tokens=1, vram_budget_bytes=8 * layout.blob_bytes(0),
                                            map_experts="always"), tracer=Tracer(str(path)))
    try:
        await _preload(sched)
        await sched.score(TOKENS[:6])
    finally:
        await sched.aclose()
    sched.tracer.close()
    recs = load(str(path))
    assert [r["experts_mode"] for r in recs] == ["mapped"] * 6
    k = model.cfg.n_expert_used
    for r, (ids, res) in zip(recs, be.tokens):
        assert [e[2] for e in r["experts"]] == res.sum(axis=1).tolist()
        misses = (~res).sum(axis=1)
        assert r["mapped"] == [int(misses.sum()), sum(int(m) * layout.blob_bytes(il) for il, m in enumerate(misses))]
        assert all(e[1] == k for e in r["experts"])
    (d,) = [p for p in summarize(recs) if p.phase == "prefill"] or summarize(recs)
    assert d.mapped_steps == 6 and abs(sum(d.ms[x] for x in d.ms if x != "total") - d.ms["total"]) < 1e-6
    assert "mapped: 6 of 6 steps" in format_summary([d])


def test_cache_twin_protocol(realistic_gguf):
    """The twin's checks: slots in range, a mapped launch needs map_experts and one row, blobs for every layer."""
    model = load_model(realistic_gguf)
    be = CpuBackend(model, cache_slots=2)
    lw = model.weights.layers[0]
    try:
        with pytest.raises(BackendError, match="slot 2 of 2"):
            be.load_expert(0, 0, 2, *(np.zeros((1, 1), np.uint8),) * 3)
        with pytest.raises(BackendError, match="map_experts first"):
            be.launch_whole(None, None)
        with pytest.raises(BackendError, match="blobs for 1 layers"):
            be.map_experts([[None] * model.cfg.n_expert])
        assert not CpuBackend(model, experts="mapped").map_experts([])
        assert not CpuBackend(model).map_experts([])              # no cache: nothing to map for
        with pytest.raises(ValueError, match="cache twin"):
            CpuBackend(model, experts="mapped", cache_slots=1)
        assert lw is not None
    finally:
        be.close()


def test_host_config_checks_map_experts():
    with pytest.raises(ValueError, match="map_experts"):
        HostConfig(map_experts="sometimes")
    with pytest.raises(ValueError, match="promote_per_layer"):
        HostConfig(promote_per_layer=-1)
    with pytest.raises(ValueError, match="cache_half_life"):
        HostConfig(cache_half_life=0)
    with pytest.raises(ValueError, match="mapped_reads"):
        HostConfig(mapped_reads="sometimes")
    for reads in MAPPED_READS:
        assert HostConfig(mapped_reads=reads).mapped_reads == reads
    for bad in (-1, 17):
        with pytest.raises(ValueError, match="prefetch_extra"):
            HostConfig(prefetch_extra=bad)
    assert HostConfig(prefetch_extra=16).prefetch_extra == 16


def test_cli_mapped_reads_are_the_engines(capsys):
    """cli.py lists the mapped_reads values itself (it imports the engine only to run): the same as the engine's."""
    import cli
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "{" + ",".join(MAPPED_READS) + "}" in capsys.readouterr().out.replace("\n", "").replace(" ", "")


def test_fetch_plan_with_a_prefetch():
    """moe_fetch's numpy plan (the GPU test holds the kernel to it): a miss the previous layer's prefetch already
    fetched takes the prefetch's addresses and is not copied again; other misses are copied into this fetch's
    staging, resident experts keep their slots. prefetch_stats counts misses, predicted misses, experts
    prefetched and their bytes over layers 1 on."""
    from strata.kernels.moe import FetchLayout, fetch_table, prefetch_stats
    lay = FetchLayout(100, 100, 60)
    lo, hi = 1 << 40, (1 << 40) + (1 << 30)                  # the device's range; host blobs below it
    ptab = np.zeros((8, 3), np.uint64)
    for e in range(8):
        base = lo + 4096 * e if e % 2 == 0 else 8192 * (e + 1) + 3      # odd experts live in host memory
        ptab[e] = [base, base + 128, base + 256]
    stage, pre_stage = lo + (1 << 20), lo + (2 << 20)
    pre = np.array([5, 2, 7, 4], np.int32)
    pre_eff, pre_copies = fetch_table(ptab, pre, lo, hi, lay, pre_stage)
    assert len(pre_copies) == 6 and pre_eff[0, 0] == pre_stage + 3 and pre_eff[1, 0] == ptab[2, 0]
    ids = np.array([1, 5, 2, 7], np.int32)
    eff, copies = fetch_table(ptab, ids, lo, hi, lay, stage, pre, pre_eff)
    assert [c[1] for c in copies] == [0, lay.off_u, lay.off_d]           # expert 1 only, into selection 0's room
    assert eff[0, 0] == stage + 3 and (eff[1] == pre_eff[0]).all() and (eff[3] == pre_eff[2]).all()
    assert (eff[2] == ptab[2]).all()
    # a prediction wider than the route (prefetch_extra): expert 1 is among its six, so nothing is copied again
    wide = np.array([5, 2, 7, 4, 1, 6], np.int32)
    wide_eff, wide_copies = fetch_table(ptab, wide, lo, hi, lay, pre_stage)
    assert len(wide_copies) == 9 and wide_eff.shape == (6, 3)
    eff, copies = fetch_table(ptab, ids, lo, hi, lay, stage, wide, wide_eff)
    assert copies == [] and (eff[0] == wide_eff[4]).all() and (eff[1] == wide_eff[0]).all()
    ids_all = np.array([[0, 1], [1, 3], [5, 6]])
    res = ids_all % 2 == 0
    preds = np.array([[0, 0], [3, 4], [5, 7]])
    pres = preds % 2 == 0
    assert prefetch_stats(ids_all, res, preds, pres, [10, 20, 30]) == (3, 2, 3, 20 + 2 * 30)
    preds = np.array([[0, 0, 2], [3, 4, 1], [5, 7, 6]])           # three a layer: expert 1 and 6 predicted too
    pres = preds % 2 == 0
    assert prefetch_stats(ids_all, res, preds, pres, [10, 20, 30]) == (3, 3, 4, 2 * 20 + 2 * 30)


@pytest.mark.parametrize("start", [0.0, 0.030, 0.005])
def test_sleep_estimate_follows_the_graph(start):
    """The scheduler sleeps through most of a whole-step graph by its estimate: from an estimate too high (a slow
    step earlier) it comes down to the graph's time, from one too low it rises, and a graph whose time changes is
    followed. Simulated: a sleep of est - slack that ends 0.8 ms late (the loop's timers), then polls every 0.1 ms
    until the graph's end. (Blending the measured wait in as before left a 30 ms estimate at ~22 ms after 60
    steps of a 14 ms graph: the wait measured the sleep.)"""
    from strata.host.scheduler import TIMER_SLACK_S, next_sleep_estimate

    def settle(est: float, graph: float, n: int = 60) -> float:
        for _ in range(n):
            slept = est - TIMER_SLACK_S if est > 2 * TIMER_SLACK_S else 0.0
            ready = slept >= graph
            took = slept + 8e-4 if ready else graph + 1e-4
            est = next_sleep_estimate(est, took, ready)
        return est
    near = lambda est, graph: 0.85 * graph <= est <= graph + 1.1 * TIMER_SLACK_S     # sleeps end by the graph's end
    est = settle(start, 0.014)
    assert near(est, 0.014), est
    assert near(settle(est, 0.009), 0.009) and near(settle(est, 0.020), 0.020)


def test_fetch_staging_holds_any_alignment():
    """moe_fetch's plan (kmoe.fetch_table, which the GPU test checks the kernel against): each missed part's
    16-byte chunks land inside its own staging room at every source alignment, the eff address points at the
    part's first byte there, and resident experts keep their table addresses."""
    from strata.kernels import moe as kmoe
    lay = kmoe.FetchLayout(1440 * 3 + 5, 1440 * 3 + 5, 2560 * 7 + 3)
    dev_lo, dev_hi, stage = 1 << 40, (1 << 40) + (1 << 30), (1 << 40) + 4096
    rng = np.random.default_rng(0)
    ptab = np.zeros((8, 3), np.uint64)
    for e in range(8):
        base = (1 << 44) + e * (1 << 20) if e % 2 else dev_lo + 8192 + e * 65536
        ptab[e] = [base + int(rng.integers(0, 16)), base + 20000 + int(rng.integers(0, 16)),
                   base + 40000 + int(rng.integers(0, 16))]
    ids = np.array([1, 2, 5, 7, 0, 3], np.int32)
    eff, copies = kmoe.fetch_table(ptab, ids, dev_lo, dev_hi, lay, stage)
    rooms = [(0, lay.off_u), (lay.off_u, lay.off_d), (lay.off_d, lay.stride)]
    sizes = (lay.n_g, lay.n_u, lay.n_d)
    assert len(copies) == 3 * 4                 # ids 1, 5, 7 and 3 are host addresses
    it = iter(copies)
    for j, e in enumerate(ids.tolist()):
        for p in range(3):
            if e % 2 == 0:
                assert eff[j, p] == ptab[e, p]
                continue
            src, d, n = next(it)
            lo, hi = rooms[p]
            assert src % 16 == 0 and n % 16 == 0 and src <= int(ptab[e, p]) < src + 16
            assert j * lay.stride + lo <= d and d + n <= j * lay.stride + hi and src + n >= int(ptab[e, p]) + sizes[p]
            assert int(eff[j, p]) == stage + d + int(ptab[e, p]) - src


def test_token_counts_equal_layer_records():
    """count_token + touch_token (a mapped token's routes at once) leave the cache as record() layer by layer."""
    rng = np.random.default_rng(3)
    a, b = VramCache(40, 1 << 30, 4, 16), VramCache(40, 1 << 30, 4, 16)
    for c in (a, b):
        for i in range(40):
            c.place(i % 4, (7 * i) % 16, 1, set())
    ids = np.stack([rng.choice(16, 4, replace=False) for _ in range(4)]).astype(np.int32)
    res = rng.random((4, 4)) < 0.6
    for il in range(4):
        a.record(il, ids[il], res[il], np.ones(4, np.int64))
    b.count_token(ids, res)
    b.touch_token(ids, res)
    assert list(a._lru) == list(b._lru) and dict(a.hits) == dict(b.hits) and dict(a.lookups) == dict(b.lookups)
    assert (a.score == b.score).all()
