"""Latency traces: records partition each step's wall time, the summary's parts sum to the measured total, overlap
is measured against device intervals, and `cli.py trace` prints the table."""

from __future__ import annotations

import json

import pytest

import cli
from strata.engine import Engine, HostConfig
from strata.host.trace import DEVICE, KINDS, WAITS, format_summary, load, overlap, summarize, union
from strata.sampling import SamplingParams


def test_union_and_overlap():
    assert union([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    assert overlap([(0, 4), (5, 6)], [(3, 5.5)]) == pytest.approx(1.5)
    assert overlap([], [(0, 1)]) == 0


def _record(t0: float, rows=((1, "decode", 1, 5),)) -> dict:
    span = lambda k, a, b: [k, 0, t0 + a, t0 + b]
    pt = sum(r[2] for r in rows if r[1] == "prompt")
    dt = sum(r[2] for r in rows if r[1] == "decode")
    return {"event": "step", "step": 1, "kind": "mixed" if pt and dt else "prefill" if pt else "decode",
            "T": pt + dt, "prompt_tokens": pt, "decode_tokens": dt, "rows": [list(r) for r in rows],
            "t0": t0, "t1": t0 + 10,
            "spans": [span("pre_launch", 0, .1), span("doorbell", .1, 2), span("cpu_wait", 2, 3),
                      span("post_launch", 3, 3.1), span("doorbell", 3.1, 5), span("head_launch", 5, 5.1),
                      span("head_wait", 5.1, 6), span("sample", 6, 6.5)],
            "io": [["ple", 100, t0 + .5, t0 + 2.5]], "cpu": [[0, 2, 1000, t0 + 1.5, t0 + 3.5]],
            "experts": [[0, 4, 1, 2, 1, 1000, 500]]}


def test_summary_of_known_records():
    (p,) = summarize([_record(0), _record(10)])
    assert p.steps == 2 and p.tokens == 2 and p.ms["total"] == pytest.approx(10)
    assert p.ms["other"] == pytest.approx(3.5)
    assert p.device_ms == pytest.approx(5.0) and p.wait_ms == pytest.approx(1.0)
    assert p.host_ms == pytest.approx(4.0)                   # sample + other: wall - device - waits
    assert p.io_ms == pytest.approx(2.0) and p.io_hidden_ms == pytest.approx(1.5)
    assert p.cpu_ms == pytest.approx(2.0) and p.cpu_hidden_ms == pytest.approx(1.0)
    assert (p.routed, p.hits, p.cpu_experts, p.fetched) == (8, 2, 4, 2) and p.expert_bytes == pytest.approx(1500)
    assert p.tok_s == pytest.approx(100.0)                   # 2 tokens in 20 ms


def test_summary_counts_tiers_and_splits_read_time():
    """Experts rows with their RAM and SSD columns, PLE rows and cache hits, peak RSS: summed and shown; the time
    reads were in flight splits into behind busy work (device, CPU pool), behind host work and exposed."""
    recs = []
    for t0 in (0, 10):
        r = _record(t0)
        r["experts"] = [[0, 4, 1, 2, 1, 1000, 500, 1, 2]]                  # of 3 misses, 1 from RAM, 2 from SSD
        r["io"] = [["expert", 4096, t0 + .5, t0 + 2.5], ["ple", 8192, t0 + 6.2, t0 + 7.0],
                   ["expert", 4096, t0 + 2.0, t0 + 2.2]]
        r["spans"].append(["io_wait", 0, t0 + 6.8, t0 + 7.2])
        r["ple"], r["peak_rss"] = [16, 4], (3 + t0) << 20
        recs.append(r)
    (p,) = summarize(recs)
    assert (p.ram_hits, p.ssd_reads, p.ple_rows, p.ple_hits) == (2, 4, 32, 8) and p.peak_rss == 13 << 20
    assert p.expert_ssd_bytes == 8192 and p.ple_ssd_bytes == 8192
    assert p.io_ms == pytest.approx(2.8)                 # [0.5, 2.5] and [6.2, 7.0] per step
    assert p.io_busy_ms == pytest.approx(2.0) and p.io_exposed_ms == pytest.approx(0.2)
    assert p.io_host_ms == pytest.approx(0.6)            # 6.2..6.8: the driver was sampling, then other host work
    out = format_summary([p])
    assert "RAM 1.0 (25.0%), SSD 2.0 (50.0%)" in out and "25.0% from the RAM cache" in out
    assert "SSD: 16.4 kB/token (experts 8.2, PLE 8.2)" in out and "exposed 0.200 ms" in out
    assert "peak RSS 13.0 MiB" in out


def test_summary_of_mapped_device_times():
    """Mapped steps' device times (the CUDA backend's events): the table copy and graph averaged over the steps
    that carry them, the promotions' bytes over their copy time as a rate."""
    recs = [_record(0), _record(10), _record(20)]
    for r, dev in zip(recs, ([0.5, 10.0, 4, 4_000_000, 1.0], [0.25, 12.0, 2, 2_000_000, 0.5])):
        r["experts_mode"], r["mapped"], r["mapped_dev"] = "mapped", [3, 3_000_000], dev
    (p,) = summarize(recs)
    assert p.mapped_dev == (2, 0.75, 22.0, 6, 6_000_000, 1.5)
    out = format_summary([p])
    assert "(2 steps timed): address table copy 0.375 ms + graph 11.000 ms a step" in out
    assert "promotions 3.0 experts, 3.00 MB a step, copied in 0.750 ms (4.0 GB/s)" in out


def test_summary_of_mapped_prefetch():
    """A mapped token's prefetch (mapped_reads="prefetch"): experts and bytes fetched a layer early per step, the
    share of the VRAM misses predicted and of the prefetched experts used; records from before the bytes field
    (three numbers) still sum."""
    recs = [_record(0), _record(10)]
    for r, pf in zip(recs, ([8, 10, 6, 8_000_000], [4, 10, 2])):
        r["experts_mode"], r["mapped"], r["prefetch"] = "mapped", [10, 10_000_000], pf
    (p,) = summarize(recs)
    assert p.prefetch == (12, 20, 8, 8_000_000)
    out = format_summary([p])
    assert "prefetch (mapped_reads prefetch): 6.0 experts/step, 4.00 MB/step fetched a layer early" in out
    assert "40.0% of the VRAM misses predicted, 66.7% of the experts fetched used" in out


def test_summary_by_step_kind():
    """Steps are summarized by what they carried: prompt rows only, decode rows only, or both; tok/s counts every
    row of a kind's steps against their summed wall time."""
    recs = [_record(0, ((1, "prompt", 30, 0),)), _record(10, ((1, "decode", 1, 30), (2, "prompt", 9, 0))),
            _record(20, ((1, "decode", 1, 31), (2, "decode", 1, 9)))]
    by = {p.phase: p for p in summarize(recs)}
    assert set(by) == {"prefill", "mixed", "decode"}
    assert by["prefill"].tok_s == pytest.approx(3000.0) and by["prefill"].prompt_tokens == 30
    assert (by["mixed"].prompt_tokens, by["mixed"].decode_tokens, by["mixed"].tokens) == (9, 1, 10)
    assert by["decode"].tok_s == pytest.approx(200.0)


def test_load_names_a_broken_line(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps(_record(0)) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:2"):
        load(str(f))


@pytest.mark.asyncio
@pytest.mark.parametrize("experts", ["host", "mapped"])
async def test_engine_trace_partitions_each_step(tiny_gguf, tmp_path, capsys, experts):
    path = tmp_path / "trace.jsonl"
    # PLE rows read from the file (no RAM cache), so that each step traces its reads
    async with await Engine.open(tiny_gguf, trace=path, host=HostConfig(experts=experts, ple_cache_bytes=0)) as e:
        async for _ in e.generate("Once upon a time", SamplingParams(max_tokens=5, stop_at_eos=False)):
            pass
        e.flush_trace()                          # the records are in the file while the engine runs
        live = load(str(path))
    recs = load(str(path))
    assert live == recs
    n_prompt = len(e.prompt_ids("Once upon a time"))
    assert [(r["kind"], r["T"]) for r in recs] == [("prefill", n_prompt)] + [("decode", 1)] * 4
    assert recs[0]["rows"] == [[recs[0]["rows"][0][0], "prompt", n_prompt, 0]]
    for r in recs:
        spans = r["spans"]
        assert all(r["t0"] <= a <= b <= r["t1"] for _, _, a, b in spans)
        assert all(spans[i][3] <= spans[i + 1][2] for i in range(len(spans) - 1)), "driver spans overlap"
        assert {k for k, *_ in spans} <= set(KINDS)
        assert sorted({s[1] for s in spans if s[0] == "doorbell"}) == list(range(e.cfg.n_layer))
        assert [x[0] for x in r["experts"]] == list(range(e.cfg.n_layer))
        assert all(x[1] == r["T"] * e.cfg.n_expert_used for x in r["experts"])     # (row, expert) pairs
        assert any(x[0] == "ple" and x[1] > 0 for x in r["io"])
    for p in summarize(recs):
        parts = sum(p.ms[k] for k in KINDS) + p.ms["other"]
        assert parts == pytest.approx(p.ms["total"], abs=1e-9)
        assert p.host_ms == pytest.approx(p.ms["total"] - sum(p.ms[k] for k in DEVICE) - sum(p.ms[k] for k in WAITS))
        distinct = sum(x[2] + x[3] for r in recs if r["kind"] == p.phase for x in r["experts"])
        if experts == "host":                                # every distinct expert on the host's CPU pool
            assert p.hits == p.fetched == 0 and p.cpu_experts == distinct > 0
        else:                                                # every one resident: the backend computed them
            assert p.cpu_experts == p.fetched == p.cpu_ms == 0 and p.hits == distinct > 0

    assert cli.main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "other/host (residual)" in out and "total (measured wall)" in out and "hidden behind device" in out
    assert out.count("ms/step") >= 2 and "decode: 4 steps, 4 decoded tokens" in out
    assert f"prefill: 1 steps, {n_prompt} prompt tokens" in out


def test_gc_pauses_are_recorded_and_summarized():
    """A full collection inside a step's interval is in its record's "gc" list (generation 2, inside the step),
    and the summary counts the pauses and prints them."""
    import gc

    from strata.host.trace import StepTrace, clock, gc_pauses, watch_gc
    watch_gc()
    st = StepTrace(1, [[1, "decode", 1, 0]], clock())
    gc.collect()
    st.t1 = clock()
    pauses = gc_pauses(st.t0, st.t1)
    assert any(g == 2 and st.t0 <= a <= b <= st.t1 for g, a, b in pauses)
    rec = st.record()
    assert [g for g, *_ in rec["gc"]] == [g for g, *_ in pauses]
    assert all(rec["t0"] <= a <= b <= rec["t1"] for _, a, b in rec["gc"])
    assert gc_pauses(st.t1 + 1.0, st.t1 + 2.0) == []

    recs = [_record(0), _record(10)]
    recs[0]["gc"] = [[0, 1.0, 1.5], [2, 4.0, 6.0]]
    recs[1]["gc"] = [[1, 12.0, 12.5]]
    (p,) = summarize(recs)
    assert (p.gc_n, p.gc_ms, p.gc_max_ms) == (3, pytest.approx(1.5), pytest.approx(2.0))
    assert p.ms["total"] == pytest.approx(10)            # pauses lie inside the spans: the partition is unchanged
    assert "Python's collector: 3 runs, 1.500 ms/step of pauses" in format_summary([p])


def test_records_are_written_by_a_thread(tmp_path):
    """emit hands the step to the writer thread; flush makes everything emitted so far readable, in order (steps
    and prefix events); a write that fails is raised by the next emit, naming the file, and nothing hangs."""
    import threading

    from strata.host.trace import StepTrace, Tracer, clock
    path = tmp_path / "t.jsonl"
    tr = Tracer(str(path))
    main = threading.get_ident()
    seen = []
    real = StepTrace.record

    def record(self):
        seen.append(threading.get_ident())
        return real(self)
    try:
        StepTrace.record = record
        for i in range(3):
            t0 = clock()
            st = StepTrace(i + 1, [[7, "decode", 1, 10 + i]], t0)
            st.span("sample", -1, t0, t0 + 1e-4)
            st.t1 = t0 + 2e-4
            tr.emit(st)
            if i == 1:
                tr.prefix(7, 5, 9)
        tr.flush()
        recs = load(str(path))
        assert [r["step"] for r in recs] == [1, 2, 3] and [r["rows"][0][3] for r in recs] == [10, 11, 12]
        assert load(str(path), "prefix") == [{"event": "prefix", "req": 7, "reused": 5, "prompt": 9}]
        assert seen and main not in seen
        tr._log = type("Broken", (), {"info": lambda *a, **k: (_ for _ in ()).throw(OSError("disk full"))})()
        tr.emit(StepTrace(4, [], clock()))
        tr.flush()
        with pytest.raises(OSError, match="t.jsonl could not be written: disk full"):
            tr.emit(StepTrace(5, [], clock()))
    finally:
        StepTrace.record = real
        tr.close()
    assert len(load(str(path))) == 3


def test_records_emitted_before_exit_are_written(tmp_path):
    """A process that exits without closing its engine's tracer still writes every record it emitted."""
    import subprocess
    import sys
    path = tmp_path / "t.jsonl"
    code = ("from strata.host.trace import Tracer, StepTrace, clock\n"
            f"tr = Tracer({str(path)!r})\n"
            "for i in range(200):\n"
            "    t0 = clock(); st = StepTrace(i, [[1, 'decode', 1, i]], t0); st.t1 = t0; tr.emit(st)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert [r["step"] for r in load(str(path))] == list(range(200))
