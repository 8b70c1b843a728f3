"""The whole GPU check and benchmark in one command, phase by phase (each well under 10 minutes):

    python bench/gpu_check.py                   # all phases
    python bench/gpu_check.py --kernels-only    # pytest tests/test_cuda_kernels.py, nothing else
    python bench/gpu_check.py --phases model,bench

tests     pytest of tests/test_cuda_kernels.py and tests/test_cuda_backend.py
gemv      GB/s of the GEMV kernels at the flash shapes (and the hc read's up_mix), per weight type: random valid blocks, enough copies of each
          matrix to rotate through more than twice the L2 (120 MB), a captured graph of back-to-back launches
          timed with events (median of 15 replays, per launch), next to 4.2 TB/s
qsa       QSA attention (qsa_attn + qsa_combine) at the flash heads: a 4096-row prefill chunk past the budget at
          two positions and one decode row, ms and fp32 TFLOP/s (phase_qsa)
gdn       the chunk's GDN core at the flash heads (16 key heads, 48 value heads of 128): gdn_conv, gdn_prep,
          gdn_scan and gdn_out over a 4096-row chunk, ms each (phase_gdn)
ple       the PLE block at the flash geometry over a 4096-row chunk and one decode row: ple_gate, ple_conv, ple_hist,
          ms each (phase_ple)
moe       the chunk's routed experts at the flash geometry (512 experts top-10, Q2_0, realistic skew): moe_group and
          each grouped launch over a 4096-row chunk, ms and TFLOP/s each (phase_moe)
mapped    one layer's expert kernels of a mapped decode token with 0, 1, 2, 5, 10 of its 10 experts read from pinned
          host memory over PCIe: ms a layer (phase_mapped)
model     `cli.py make-model --preset flash --ple-base 2000000 models/flash.gguf` unless that file exists (the
          bench phase runs it first when the file is missing)
profile   the flash model with every weight in VRAM: `tokens` whole-token graphs between cuProfilerStart and Stop,
          for Nsight Compute to time every kernel node in isolation (bench/gpu_profile.sh runs it under ncu and
          sums the nodes by kernel and grid: bench/ncu_table.py); the graph's own ms/token is printed first
overlap   pinned-memory reads over PCIe (48 moe_fetch launches) alone and beside the all-VRAM token graph on
          another stream, at two grids and two stream priorities: whether they hide behind compute (phase_overlap)
ablate    the whole-token graph without each kind of launch in turn (ms it saves, per launch left out), and
          chains of 720 near-empty launches: what a launch costs inside the graph (phase_ablate)
bench     the flash model with every weight in VRAM: decode ms/token (whole-token graph, warm-up excluded, median)
          at a short and at a long context (past the QSA budget, so block selection runs), the per-layer protocol
          (doorbell, host polling) ms/token, a per-stage breakdown from events recorded between stage graphs
          (their parts sum to that run's total, printed), bytes read per token and the fraction of 4.2 TB/s,
          and the doorbell's launch-to-host-seen latency (median, p90)

A short table is printed last; everything goes to $OUT/gpu_check.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
HBM_BPS = 4.2e12
FLASH = ROOT / "models" / "flash.gguf"      # --model replaces it
ROUTING = "uniform"                         # --routing: make-model's, when the model phase makes the file
RESULTS: dict = {}


def say(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def phase_tests(files: list[str]) -> None:
    t0 = time.time()
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-s", "-m", "gpu", *files]     # the GPU rig (not the emulator)
    say("running " + " ".join(cmd[2:]))
    rc = subprocess.call(cmd, cwd=ROOT)
    RESULTS["tests"] = {"files": files, "rc": rc, "seconds": round(time.time() - t0, 1)}
    say(f"tests finished with exit code {rc} in {time.time() - t0:.0f}s")
    if rc != 0:
        raise SystemExit(rc)


def phase_model() -> None:
    if FLASH.exists():
        say(f"reusing {FLASH} ({FLASH.stat().st_size / 2**30:.1f} GiB)")
        return
    FLASH.parent.mkdir(exist_ok=True)
    t0 = time.time()
    cmd = [sys.executable, "cli.py", "make-model", "--preset", "flash", "--ple-base", "2000000", "--routing", ROUTING,
           str(FLASH)]
    say("making the flash model: " + " ".join(cmd[1:]))
    rc = subprocess.call(cmd, cwd=ROOT)
    RESULTS["model"] = {"rc": rc, "seconds": round(time.time() - t0, 1)}
    if rc != 0:
        FLASH.unlink(missing_ok=True)
        raise SystemExit(f"make-model failed with {rc}")
    say(f"made {FLASH} in {time.time() - t0:.0f}s")


class Feeder:
    """Random tokens and their PLE vectors, as the host would stage them."""

    def __init__(self, model, seed: int = 0):
        from strata.reference.ple import NgramWindow
        self.m, self.cfg = model, model.cfg
        self.rng = np.random.default_rng(seed)
        self.window = NgramWindow.start(self.cfg) if self.cfg.ple_layers else None

    def next(self) -> tuple[int, np.ndarray | None]:
        """A token and its PLE vector (ple_dim,)."""
        from strata.reference.ple import ple_gather, ple_rows
        t = int(self.rng.integers(0, self.cfg.n_vocab))
        e = None
        if self.window is not None:
            e = ple_gather(self.m.weights.per_layer_token_embd, ple_rows(self.cfg, [t], self.window))[0]
            self.window.advance(self.cfg, t)
        return t, e

    def step(self, seq) -> tuple[object, np.ndarray | None]:
        """The next one-row step of seq and its PLE vectors (1, ple_dim)."""
        from strata.host.backend import Segment, Step
        t, e = self.next()
        return Step((Segment(seq, (t,), seq.pos),)), None if e is None else e[None]


def _wait(poll):
    while (got := poll()) is None:
        pass
    return got


def decode_ms(be, seq, feed, n: int) -> np.ndarray:
    """n tokens through the whole-token graph: GPU ms per token from events around each launch."""
    from strata.cuda import driver as drv
    e0, e1 = drv.Event(timing=True), drv.Event(timing=True)
    out = []
    for _ in range(n):
        step, e = feed.step(seq)
        e0.record(be.stream)
        be.launch_whole(step, e)
        e1.record(be.stream)
        _wait(be.poll_logits)
        out.append(e1.elapsed_ms(e0))
    return np.array(out)


def protocol_ms(be, seq, feed, n: int) -> np.ndarray:
    """n tokens through the per-layer protocol (every expert resident): host wall-clock ms per token."""
    from strata.host.backend import ExpertPlan
    cfg = be.cfg
    out = []
    for _ in range(n):
        step, e = feed.step(seq)
        t0 = time.perf_counter()
        be.begin(step)
        if e is not None:
            be.stage_ple(e)
        for il in range(cfg.n_layer):
            be.launch_pre(il)
            r = _wait(lambda: be.poll_route(il))
            plan = ExpertPlan.of(il, r.ids, cfg.n_embd)
            plan.resident[:] = True
            be.launch_post(plan)
        be.launch_head()
        _wait(be.poll_logits)
        out.append((time.perf_counter() - t0) * 1e3)
    return np.array(out)


GEMV_CASES = [   # (label, type, n_out, n_in, kind): kind gemv | glu | experts
    ("attn_qkv", "IQ4_XS", 10240, 2560, "gemv"),
    ("attn_gate", "IQ4_XS", 6144, 2560, "gemv"),
    ("ssm_out", "Q4_K", 2560, 6144, "gemv"),
    ("attn_q (QSA)", "Q4_K", 12288, 2560, "gemv"),
    ("hc down", "Q8_0", 320, 10240, "gemv"),
    ("router", "BF16", 512, 2560, "gemv"),
    ("shexp gate+up", "Q5_K", 640, 2560, "glu"),
    ("shexp down", "Q8_0", 2560, 640, "gemv"),
    ("LM head", "Q6_K", 248320, 2560, "gemv"),
    ("experts x10 (g+u, down)", "Q2_0", 640, 2560, "experts"),
    ("hc up + mix (up_mix)", "Q8_0", 10240, 320, "up_mix"),
]


def graph_ms(label: str, stream, launches=(), body=None, reps: int = 15, warm: int = 1) -> float:
    """Median ms of `reps` replays of a captured graph of `launches` in order (or of what body() enqueues on
    `stream`), after `warm` warm-up replays."""
    from strata.cuda import driver as drv
    from strata.cuda.graphs import Graph
    graph = Graph(label, stream, body or (lambda: [l.enqueue(stream) for l in launches]))
    e0, e1 = drv.Event(timing=True), drv.Event(timing=True)
    for _ in range(warm):
        graph.launch(stream)
    stream.synchronize("warm-up")
    times = []
    for _ in range(reps):
        e0.record(stream)
        graph.launch(stream)
        e1.record(stream)
        e1.synchronize(label)
        times.append(e1.elapsed_ms(e0))
    graph.destroy()
    e0.destroy()
    e1.destroy()
    return float(np.median(times))


def phase_rig(seed: int):
    """(kernels, stream, rng, arena, arch) of a phase that times launches on this machine's GPU."""
    from strata.cuda import driver as drv
    from strata.cuda.arena import Arena
    from strata.kernels import Kernels
    arch = drv.Device.open().arch
    return Kernels(arch), drv.Stream(), np.random.default_rng(seed), Arena(), arch


def step_block(pos: int, rows: int) -> np.ndarray:
    """The step block (common.cuh) of a step of `rows` rows from position `pos`, one logit row."""
    w = np.zeros(16, np.int32)
    w[1], w[3], w[4] = pos, rows, 1
    return w


def sweep_geoms(n_out: int, rb: int, halves: int, xq: int):
    """Every GEMV geometry whose tile ring (and xq bytes of x limbs) leave room for 2 CTAs a multiprocessor."""
    from strata.kernels.gemv import CTA_THREADS, Geom, tile_fits
    tpg = 4
    while tpg <= CTA_THREADS:
        for rr in (1, 2, 3, 4):
            g = Geom(tpg, rr, CTA_THREADS)
            if tile_fits(g, n_out, rb, halves, xq):
                yield g
        tpg *= 2


def phase_gemv(sweep: bool = False, once: bool = False) -> None:
    """Per-launch time and GB/s of the GEMV kernels at the flash shapes (see the module docstring); with `sweep`,
    every geometry of each dense matrix as well, next to the time model's pick. With `once`, each matrix's
    launches (one matrix, or one set of experts) run once, eagerly and untimed: what a profiler (ncu) is given."""
    from types import SimpleNamespace

    from strata.cuda import driver as drv
    from strata.cuda.arena import Arena, DevMat
    from strata.cuda.driver import check, cu
    from strata.cuda.launch import pdl_status
    from strata.kernels import Kernels
    from strata.kernels import gemv as kgemv
    from strata.kernels import moe as kmoe
    from strata.kernels.gemv import Job, device_row_bytes
    from strata.quant import QType, random_blocks
    dev = drv.Device.open()
    K = Kernels(dev.arch)
    stream = drv.Stream()
    rng = np.random.default_rng(1)
    rows_out, sweep_rows = [], []
    say(pdl_status())

    def launch_us(label, launches) -> float:
        """Median ms per launch of a captured graph of back-to-back launches (15 replays after a warm-up)."""
        if once:
            for l in launches[:2 if label.startswith("experts") else 1]:
                l.enqueue(stream)
            stream.synchronize("profiled launch")
            return float("nan")
        reps = max(1, 24 // len(launches))
        return graph_ms(f"gemv bench {label}", stream, [l for _ in range(reps) for l in launches]) / (reps * len(launches))
    for label, tname, n_out, n_in, kind in GEMV_CASES:
        qt = QType[tname]
        rb = device_row_bytes(qt, n_in)
        A = Arena()
        if kind == "experts":
            n_exp, k = 64, 10                       # 64 experts x 3.5 MB: 221 MB, 6 rotating sets of 10
            g = A.reserve("gate", (n_exp * n_out * rb,), np.uint8)
            u = A.reserve("up", (n_exp * n_out * rb,), np.uint8)
            rbd = device_row_bytes(qt, n_out)
            d = A.reserve("down", (n_exp * n_in * rbd,), np.uint8)
            sets = 6
            slots = [A.reserve(f"slots{i}", (k,), np.int32) for i in range(sets)]
            jobs = [A.reserve(f"job{i}", (kmoe.MOE_JOB_DTYPE.itemsize,), np.uint8) for i in range(sets)]
            x = A.reserve("x", (n_in,))
            h = A.reserve("h", (k, (n_out + 7) // 8 * 8))
            out = A.reserve("out", (k, n_in))
            A.commit()
            one = random_blocks(qt, (n_out, n_in), rng, 1 / np.sqrt(n_in)).reshape(-1)
            oned = random_blocks(qt, (n_in, n_out), rng, 1 / np.sqrt(n_out)).reshape(-1)
            for e in range(n_exp):
                for buf, src in ((g, one), (u, one), (d, oned)):
                    drv.memcpy_htod_async(buf.ptr + e * src.nbytes, src.ctypes.data, src.nbytes, stream, "w")
                    stream.synchronize("upload")
            x.upload(rng.standard_normal(n_in).astype(np.float32))
            cfg = SimpleNamespace(n_embd=n_in, n_ff_exp=n_out, n_expert_used=k)
            bank = kmoe.ExpertBank(DevMat(g, int(qt), n_out, n_in, rb, n_exp), 0, DevMat(u, int(qt), n_out, n_in, rb, n_exp),
                                   0, DevMat(d, int(qt), n_in, n_out, rbd, n_exp), 0,
                                   (n_out * rb, n_out * rb, n_in * rbd))
            launches = []
            for i in range(sets):
                slots[i].upload(np.arange(i * k, (i + 1) * k, dtype=np.int32))
                launches += list(kmoe.expert_launches(K.fn("moe", "moe_gate_up"), K.fn("moe", "moe_down"), label, cfg,
                                                      jobs[i], bank, slots[i], x, h, out))
            per_launch_bytes = k * (2 * n_out * rb + n_in * rbd)   # a launch: gate/up + down of k experts
        elif kind == "up_mix":               # the hc read's up-projection with its gated stream mean
            from strata.kernels import hc as khc
            hc, E = 4, n_out // 4
            mat_bytes = n_out * rb
            copies = max(1, -(-120_000_000 // mat_bytes))
            W = A.reserve("up", (copies * mat_bytes,), np.uint8)
            lo, xn, mixed = A.reserve("lo", (n_in,)), A.reserve("xn", (n_out,)), A.reserve("mixed", (E,))
            A.commit()
            one = random_blocks(qt, (n_out, n_in), rng, 1 / np.sqrt(n_in)).reshape(-1)
            for i in range(copies):
                drv.memcpy_htod_async(W.ptr + i * mat_bytes, one.ctypes.data, mat_bytes, stream, "w")
                stream.synchronize("upload")
            lo.upload(rng.standard_normal(n_in).astype(np.float32))
            xn.upload(rng.standard_normal(n_out).astype(np.float32))
            ups = [DevMat(W.view(f"up{i}", i * mat_bytes, (mat_bytes,), np.uint8), int(qt), n_out, n_in, rb)
                   for i in range(copies)]

            def mix_launches(geom=None):
                return [khc.up_mix_launch(K.fn("hc", "up_mix"), label, u, lo, xn, mixed, hc, E, geom) for u in ups]
            per_launch_bytes = mat_bytes
            if sweep:
                picked = khc.up_mix_geometry(qt, n_in, rb, hc, E)
                for geom in khc.up_mix_geoms(rb, hc, E):
                    us = launch_us(f"{label} sweep", mix_launches(geom)) * 1e3
                    sweep_rows.append({"label": label, "nt": geom.nt, "tpg": geom.tpg, "rr": geom.rr, "us": us,
                                       "gbps": per_launch_bytes / (us * 1e-6) / 1e9, "picked": geom == picked})
                    say(f"  sweep {label} nt {geom.nt:3d} tpg {geom.tpg:3d}: {us:7.1f} us"
                        + (" (the current pick)" if geom == picked else ""))
            launches = mix_launches()
        else:
            halves = 2 if kind == "glu" else 1
            mat_bytes = n_out * rb
            copies = max(1, -(-120_000_000 // (mat_bytes * halves)))
            W = A.reserve("w", (copies * halves * mat_bytes,), np.uint8)
            x = A.reserve("x", (n_in,))
            y = A.reserve("y", (n_out,))
            tables = [kgemv.job_table(f"t{i}", 1, A.reserve) for i in range(copies)]
            A.commit()
            chunk = min(n_out, 24832)
            one = random_blocks(qt, (chunk, n_in), rng, 1 / np.sqrt(n_in)).reshape(-1)
            for off in range(0, copies * halves * mat_bytes, one.nbytes):
                nb = min(one.nbytes, copies * halves * mat_bytes - off)
                drv.memcpy_htod_async(W.ptr + off, one.ctypes.data, nb, stream, "w")
                stream.synchronize("upload")
            x.upload(rng.standard_normal(n_in).astype(np.float32))
            m = DevMat(W, int(qt), n_out, n_in, rb, copies * halves)
            # a GLU partner: the matrix after w in the same buffer (mat i * 2 + 1)
            w2 = None if halves == 1 else DevMat(W.view("w2", mat_bytes, ((copies * 2 - 1) * mat_bytes,), np.uint8),
                                                 int(qt), n_out, n_in, rb, copies * 2 - 1)

            def gemv_launches(geom=None):
                return [kgemv.gemv_launch(K.fn("gemv", "gemv_jobs"), label, tables[i],
                                          [Job(m, x, y, w2=w2, mat=i * halves)], geom) for i in range(copies)]
            per_launch_bytes = mat_bytes * halves
            if sweep:
                picked = kgemv.geometry(qt, n_in, n_out, rb, halves=halves)
                for geom in sweep_geoms(n_out, rb, halves, kgemv.xq_bytes(qt, n_in)):
                    us = launch_us(f"{label} sweep", gemv_launches(geom)) * 1e3
                    sweep_rows.append({"label": label, "tpg": geom.tpg, "rr": geom.rr, "us": us,
                                       "gbps": per_launch_bytes / (us * 1e-6) / 1e9, "picked": geom == picked})
                    say(f"  sweep {label} tpg {geom.tpg:3d} rr {geom.rr}: {us:7.1f} us"
                        + (" (the time model's pick)" if geom == picked else ""))
            launches = gemv_launches()      # after the sweep: the tables hold the time model's geometry again
        t = launch_us(label, launches)
        ctas = launches[0].grid[0] * launches[0].grid[1]
        extra = {}
        if sweep:             # resident tiles per SM, and the same launches with the largest shared carveout
            fn, smem = launches[0].fn, launches[0].smem
            occ = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, launches[0].block[0], smem), "occupancy")
            carve = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
            check(cu.cuFuncSetAttribute(fn, carve, 100), "carveout")
            t_max = launch_us(label, launches)
            check(cu.cuFuncSetAttribute(fn, carve, -1), "carveout")
            say(f"  {label}: {occ} CTAs/SM by occupancy ({smem} B shared a CTA); with the shared carveout at 100%: "
                f"{t_max * 1e3:.1f} us against {t * 1e3:.1f}")
            extra = {"occupancy": occ, "us_carveout100": t_max * 1e3}
        rows_out.append({"label": label, "type": tname, "shape": f"{n_out}x{n_in}" + (" x10" if kind == "experts" else ""),
                         "mb": per_launch_bytes / 1e6, "us": t * 1e3, "gbps": per_launch_bytes / (t * 1e-3) / 1e9,
                         "ctas": ctas, "smem": launches[0].smem, **extra})
        say(f"gemv {label}: {rows_out[-1]['us']:.1f} us, {rows_out[-1]['gbps']:.0f} GB/s")
        A.free()
    stream.destroy()
    RESULTS["gemv"] = {"rows": rows_out, "pdl": pdl_status(), "sweep": sweep_rows}


def phase_gdn(rows: int = 4096) -> None:
    """The batched GDN core at the flash heads over a chunk of `rows` (random inputs, a state carried across the
    replays): gdn_conv, gdn_prep, gdn_scan, gdn_out, each the median ms of 15 replays of its own captured graph."""
    from strata.kernels import gdn as kgdn
    from strata.model.synth import preset_config
    cfg = preset_config("flash")
    Hk, Hv, D, K, cd, vd = (cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_conv, cfg.conv_dim,
                            cfg.value_dim)
    kern, stream, rng, A, _ = phase_rig(5)
    bufs = {n: A.reserve(n, shape) for n, shape in (
        ("qkv", (rows, cd)), ("z", (rows, vd)), ("alpha", (rows, Hv)), ("beta", (rows, Hv)), ("conv_w", (cd, K)),
        ("dt", (Hv,)), ("A", (Hv,)), ("norm", (D,)), ("ring", (K, cd)), ("c", (rows, cd)), ("qn", (rows, Hk, D)),
        ("kn", (rows, Hk, D)), ("bt", (rows, Hv)), ("eg", (rows, Hv)), ("S", (Hv, D, D)), ("o", (rows, vd)),
        ("y", (rows, vd)))}
    step = A.reserve("step", (16,), np.int32)
    A.commit()
    for n in ("qkv", "z", "alpha", "beta", "conv_w", "dt", "norm"):
        bufs[n].upload(rng.standard_normal(bufs[n].shape).astype(np.float32))
    bufs["A"].upload(-rng.uniform(0.01, 4, Hv).astype(np.float32))
    for n in ("ring", "S"):
        bufs[n].upload(np.zeros(bufs[n].shape, np.float32))
    step.upload(step_block(8192, rows))
    b = bufs
    fn = lambda n: kern.fn("gdn", n)
    launches = {
        "gdn_conv": kgdn.gdn_conv_launch(fn("gdn_conv"), "conv", cfg, b["qkv"], b["conv_w"], b["ring"], b["c"], step,
                                         rows),
        "gdn_prep": kgdn.gdn_prep_launch(fn("gdn_prep"), "prep", cfg, b["c"], b["qkv"], b["alpha"], b["beta"],
                                         b["dt"], b["A"], b["qn"], b["kn"], b["bt"], b["eg"], b["ring"], step, rows),
        "gdn_scan": kgdn.gdn_scan_launch(fn("gdn_scan"), "scan", cfg, b["qn"], b["kn"], b["c"], b["bt"], b["eg"],
                                         b["S"], b["o"], step, rows),
        "gdn_out": kgdn.gdn_out_launch(fn("gdn_out"), "out", cfg, b["o"], b["z"], b["norm"], b["y"], step, rows)}
    for l in launches.values():             # inputs for the scan and the norm: one eager pass
        l.enqueue(stream)
    stream.synchronize("gdn inputs")
    out = {name: graph_ms(f"gdn {name}", stream, [l]) for name, l in launches.items()}
    defines = os.environ.get("STRATA_KERNEL_DEFINES", "")
    say(f"gdn {rows} rows, defines '{defines}': " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in out.items())
        + f"; scan {launches['gdn_scan'].grid} CTAs of {launches['gdn_scan'].block[0]}")
    A.free()
    stream.destroy()
    RESULTS.setdefault("gdn", []).append({"defines": defines, "rows": rows, "ms": out})


def phase_ple(rows: int = 4096, preset: str = "flash") -> None:
    """The PLE block at a preset's geometry (flash: 4 streams of 2560, a conv of 4 taps at dilation 3) over a chunk
    of `rows` and over one decode row (random inputs, a history carried across the replays): ple_gate, ple_conv,
    ple_hist, each the median ms of 15 replays of its own captured graph."""
    from strata.kernels import ple as kple
    from strata.model.synth import preset_config
    cfg = preset_config(preset)
    hc, E, C = cfg.hc, cfg.n_embd, cfg.hc_dim
    kern, stream, rng, A, _ = phase_rig(6)
    bufs = {n: A.reserve(n, shape) for n, shape in (
        ("R", (rows, C)), ("key", (rows, C)), ("value", (rows, E)), ("gate", (rows, hc)), ("nk", (C,)), ("nq", (C,)),
        ("nc", (C,)), ("conv_w", (C, cfg.ple_conv)), ("hist", (cfg.ple_hist, C)))}
    step = A.reserve("step", (16,), np.int32)
    A.commit()
    for b in bufs.values():
        b.upload(rng.standard_normal(b.shape).astype(np.float32))
    b, out = bufs, {}
    for T in (rows, 1):
        step.upload(step_block(8192, T))
        launches = kple.ple_launches(lambda n: kern.fn("ple", n), "ple", cfg, b["R"], b["key"], b["value"],
                                     b["gate"], b["nk"], b["nq"], b["nc"], b["conv_w"], b["hist"], step, T)
        out.update({f"{l.name.split('.')[1]} {T}": graph_ms(f"ple {l.name}", stream, [l]) for l in launches})
        out[f"all {T}"] = graph_ms("ple", stream, list(launches))
    say(f"ple {rows} rows and 1: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in out.items()))
    A.free()
    stream.destroy()
    RESULTS.setdefault("ple", []).append({"rows": rows, "ms": out})


def phase_qsa() -> None:
    """QSA attention (qsa_attn + qsa_combine) at the flash heads (24 query heads of 256, 2 kv heads, a budget of
    2048 cells): a 4096-row prefill chunk at positions 4096 and 28672 (every query past the budget: 512 selected
    blocks + its tail, random selections) and one decode row at 8192, against a 32K-cell cache (128 MB of K and V,
    past the L2). Median ms of 15 replays of a captured graph, after a warm-up."""
    from strata.cuda import driver as drv
    from strata.cuda.arena import Arena
    from strata.kernels import Kernels
    from strata.kernels import qsa as kqsa
    from strata.model.synth import preset_config
    cfg = preset_config("flash")
    il = cfg.compress_ratios.index(4)
    H, Hkv, D, ratio, topk = cfg.n_head, cfg.n_head_kv, cfg.head_dim, 4, cfg.block_topk(il)
    dev = drv.Device.open()
    K = Kernels(dev.arch)
    stream = drv.Stream()
    rng = np.random.default_rng(3)
    max_ctx, rows_max = 32768, 4096
    ld = max_ctx // ratio
    A = Arena()
    q = A.reserve("q", (rows_max, H, D))
    Kc, Vc = A.reserve("Kc", (max_ctx, Hkv, D)), A.reserve("Vc", (max_ctx, Hkv, D))
    qg, att = A.reserve("qg", (rows_max, H, 2 * D)), A.reserve("att", (rows_max, H * D))
    sel, meta = A.reserve("sel", (rows_max, ld), np.int32), A.reserve("meta", (rows_max, 2), np.int32)
    step = A.reserve("step", (16,), np.int32)
    nsplit_max = 64
    part = A.reserve("part", (rows_max * H * max(4, nsplit_max // rows_max) * (D + 2),))
    A.commit()
    for buf, shape in ((q, (rows_max, H, D)), (Kc, (max_ctx, Hkv, D)), (Vc, (max_ctx, Hkv, D)),
                       (qg, (rows_max, H, 2 * D))):
        buf.upload(rng.standard_normal(shape).astype(np.float32))
    out = []
    for label, pos, rows, nsplit in (("prefill 4096 rows at 4096", 4096, 4096, 4), ("prefill 4096 rows at 28672",
                                     28672, 4096, 4), ("decode 1 row at 8192", 8192, 1, nsplit_max)):
        s_host = np.zeros((rows, ld), np.int32)
        m_host = np.zeros((rows, 2), np.int32)
        for r in range(rows):
            t = pos + r
            nb = (t + 1) // ratio
            s_host[r, :topk] = np.sort(rng.choice(nb, topk, replace=False))
            m_host[r] = topk, topk * ratio + (t + 1 - nb * ratio)
        sel.upload(s_host)
        meta.upload(m_host)
        w = np.zeros(16, np.int32)
        w[1], w[3], w[4] = pos, rows, 1
        step.upload(w)
        for tc in (False, True) if rows > 1 else (False,):      # the batched step's tensor-core kernel too
            kern = "qsa_attn_tc" if tc else "qsa_attn"
            launches = [kqsa.attn_launch(lambda n: K.fn("qsa", n), "attn", cfg, il, q, Kc, Vc, sel, meta, part, step,
                                         max_ctx, nsplit, rows, ld, tc=tc),
                        kqsa.combine_launch(K.fn("qsa", "qsa_combine"), "combine", cfg, part, qg, att, nsplit, step,
                                            rows)]
            times = {name: graph_ms(f"qsa {label} {kern}", stream, ls)
                     for name, ls in (("attn", launches[:1]), ("attn+combine", launches))}
            cells = int(m_host[:, 1].sum())
            gflop = 4 * cells * H * D / 1e9          # q.k and p.v, 2 flops a multiply-add
            out.append({"label": label, "kernel": kern, "rows": rows, "nsplit": nsplit, "cells": cells,
                        "attn_ms": times["attn"], "attn_combine_ms": times["attn+combine"],
                        "tflops": gflop / times["attn"], "block": launches[0].block[0]})
            say(f"qsa {label}, {kern}: attn {times['attn']:.3f} ms ({out[-1]['tflops']:.2f} TFLOP/s of f32 "
                f"products), with combine {times['attn+combine']:.3f} ms; {launches[0].block[0]} threads a CTA")
    A.free()
    stream.destroy()
    RESULTS.setdefault("qsa", []).append({"defines": os.environ.get("STRATA_KERNEL_DEFINES", ""), "rows": out})


def phase_moe(rows: int = 4096, preset: str = "flash") -> None:
    """The batched step's routed experts at a preset's geometry (flash: 512 experts of 2560 -> 640, top-10), Q2_0 as
    in the realistic mix, every expert in VRAM, over a chunk of `rows`: moe_group, then each grouped launch (the
    splits of GEMM_XPREP, gate/up, down), the median ms of 15 replays of its own captured graph, with TFLOP/s of
    useful work. Routing: make-model's realistic routing (the preset's skew, flash's where it has none; random
    weights route almost uniformly otherwise): what sets the pairs an expert gets, so the tiles' fill."""
    from strata.cuda.arena import DevMat
    from strata.cuda.weights import device_rows
    from strata.kernels import gemm as kgemm
    from strata.kernels import moe as kmoe
    from strata.model.synth import ROUTING_SKEW, preset_config
    from strata.quant.formats import QType, row_bytes
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_gemm import random_rows
    cfg = preset_config(preset)
    E, Fn, n_exp, k, qt = cfg.n_embd, cfg.n_ff_exp, cfg.n_expert, cfg.n_expert_used, QType.Q2_0
    kern, stream, rng, A, arch = phase_rig(7)
    # make-model's realistic routing (strata.model.synth): expert e's router logits scaled by exp(skew z_e),
    # z_e ~ N(0, 1), rescaled to RMS 1, over a near-isotropic input: each row's top k of N(0, s_e^2) logits
    s = np.exp(ROUTING_SKEW.get(preset, ROUTING_SKEW["flash"]) * rng.standard_normal(n_exp))
    s /= np.sqrt(np.mean(s * s))
    ids_v = np.argsort(-(rng.standard_normal((rows, n_exp)) * s), axis=1)[:, :k].astype(np.int32)
    per = np.bincount(ids_v.ravel(), minlength=n_exp)
    plan = kmoe.tile_plan(rows, k, n_exp)
    rb_gu, rb_d = row_bytes(qt, E), row_bytes(qt, Fn)
    g, u = A.reserve("gate", (n_exp * Fn * rb_gu,), np.uint8), A.reserve("up", (n_exp * Fn * rb_gu,), np.uint8)
    d = A.reserve("down", (n_exp * E * rb_d,), np.uint8)
    ids, step = A.reserve("ids", (rows, k), np.int32), A.reserve("step", (16,), np.int32)
    pair_tok, pair_of = A.reserve("pair_tok", (rows * k,), np.int32), A.reserve("pair_of", (rows * k,), np.int32)
    tiles = A.reserve("tiles", (4 * (plan.cap + plan.cap2),), np.int32)
    n_tiles = A.reserve("n_tiles", (2,), np.int32)
    job, x = A.reserve("job", (kmoe.MOE_JOB_DTYPE.itemsize,), np.uint8), A.reserve("x", (rows, E))
    h, out = A.reserve("h", (rows * k, kmoe.padded_ff(cfg))), A.reserve("out", (rows * k, E))
    gm, um = DevMat(g, int(qt), Fn, E, rb_gu, n_exp), DevMat(u, int(qt), Fn, E, rb_gu, n_exp)
    dm = DevMat(d, int(qt), E, Fn, rb_d, n_exp)
    bank = kmoe.ExpertBank(gm, 0, um, 0, dm, 0, (gm.mat_bytes, um.mat_bytes, dm.mat_bytes))
    sp_plan = kmoe.split_plan(cfg, bank, plan)
    xsb = [A.reserve(f"xs{i}", (kgemm.xsplit_bytes(*p),), np.uint8) for i, p in enumerate(sp_plan)] \
        if kgemm.XPREP and arch == 90 else None
    A.commit()
    for buf, n_out, n_in in ((g, Fn, E), (u, Fn, E), (d, E, Fn)):
        buf.upload(device_rows(random_rows(qt, n_exp * n_out, n_in, rng), qt, n_exp * n_out, n_in).reshape(-1))
    x.upload(rng.standard_normal((rows, E)).astype(np.float32))
    ids.upload(ids_v)
    step.upload(step_block(8192, rows))
    splits = tuple(kgemm.XSplit(b, *p) for b, p in zip(xsb, sp_plan)) if xsb else None
    fn = lambda n: kern.fn("moe", n)
    grp = kmoe.group_launch(fn("moe_group"), "group", cfg, ids, None, step, pair_tok, pair_of, tiles, n_tiles, rows,
                            plan)
    launches = kmoe.grouped_launches(fn, "experts", cfg, job, bank, tiles, n_tiles, x, pair_tok, h, out, rows, plan,
                                     splits, arch)
    for l in (grp, *launches):              # the tiles and every launch's inputs: one eager pass
        l.enqueue(stream)
    stream.synchronize("moe inputs")
    used = [int(v) for v in n_tiles.download()]
    times = {"moe_group": graph_ms("moe group", stream, [grp])}
    times.update({l.name.split(".", 1)[1]: graph_ms(f"moe {l.name}", stream, [l]) for l in launches})
    want = plan.tile_counts(per)
    if used != want:
        raise SystemExit(f"moe_group made {used} tiles, the plan's rule {want}")
    slots = used[0] * plan.bn + used[1] * plan.bn2
    flop = {"gate_up": 2 * 2 * rows * k * Fn * E, "down": 2 * rows * k * Fn * E}
    gemm_ms = {g: sum(ms for n, ms in times.items() if n.split(".")[0] == g) for g in flop}
    defines = os.environ.get("STRATA_KERNEL_DEFINES", "")
    lists = f"{used[0]} tiles of {plan.bn} pairs" + (f" and {used[1]} of {plan.bn2}" if plan.bn2 else "")
    say(f"moe {rows} rows top-{k} of {n_exp}, defines '{defines}': pairs an expert min {per.min()} median "
        f"{int(np.median(per))} max {per.max()}; {lists} ({rows * k / slots:.0%} filled)")
    say("moe " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in times.items()) + f"; all {sum(times.values()):.3f} ms; "
        + ", ".join(f"{g} {gemm_ms[g]:.3f} ms ({flop[g] / gemm_ms[g] / 1e9:.1f} TFLOP/s)" for g in flop))
    A.free()
    stream.destroy()
    RESULTS.setdefault("moe", []).append({"defines": defines, "rows": rows, "ms": times, "tiles": used,
                                          "bn": [plan.bn, plan.bn2], "pairs_per_expert": [int(per.min()),
                                                                                         int(np.median(per)),
                                                                                         int(per.max())]})


def phase_mapped() -> None:
    """One layer's routed experts for one decode row as a mapped token's graph runs them (moe_gate_up + moe_down
    through the layer's address table, flash shapes, Q2_0) with 0, 1, 2, 5 and 10 of the 10 read from pinned host
    memory over PCIe and the rest from VRAM: median ms a layer over 6 sets of experts (64 in VRAM, 88 MB, past the
    L2). Whether a layer's time follows its missed bytes or pays one PCIe-latency-bound expert as soon as it has a
    miss (bench/GPU_NOTES.md, 2026-12-02 second session)."""
    from types import SimpleNamespace

    from strata.cuda import driver as drv
    from strata.cuda.arena import Arena, DevMat
    from strata.kernels import Kernels
    from strata.kernels import moe as kmoe
    from strata.kernels.gemv import device_row_bytes
    from strata.quant import QType, random_blocks
    dev = drv.Device.open()
    K = Kernels(dev.arch)
    stream = drv.Stream()
    rng = np.random.default_rng(2)
    qt, E, Fn, k, n_exp, sets, n_expert = QType.Q2_0, 2560, 640, 10, 64, 6, 512
    rb, rbd = device_row_bytes(qt, E), device_row_bytes(qt, Fn)
    sizes = (Fn * rb, Fn * rb, E * rbd)                       # gate, up, down bytes of one expert
    blob = sum(sizes)
    A = Arena()
    g = A.reserve("gate", (n_exp * sizes[0],), np.uint8)
    u = A.reserve("up", (n_exp * sizes[1],), np.uint8)
    d = A.reserve("down", (n_exp * sizes[2],), np.uint8)
    ptab = A.reserve("ptab", (n_expert, 3), np.uint64)
    slots = [A.reserve(f"ids{i}", (k,), np.int32) for i in range(sets)]
    jobs = [A.reserve(f"job{i}", (kmoe.MOE_JOB_DTYPE.itemsize,), np.uint8) for i in range(sets)]
    x, h, out = A.reserve("x", (E,)), A.reserve("h", (k, (Fn + 7) // 8 * 8)), A.reserve("out", (k, E))
    A.commit()
    host = drv.HostBuffer(n_exp * blob, mapped=True, what="mapped experts")
    one = [random_blocks(qt, (Fn, E), rng, 1 / np.sqrt(E)).reshape(-1),
           random_blocks(qt, (Fn, E), rng, 1 / np.sqrt(E)).reshape(-1),
           random_blocks(qt, (E, Fn), rng, 1 / np.sqrt(Fn)).reshape(-1)]
    hv = host.array(np.uint8, (n_exp, blob))
    for e in range(n_exp):
        for part, (buf, src) in enumerate(zip((g, u, d), one)):
            drv.memcpy_htod_async(buf.ptr + e * src.nbytes, src.ctypes.data, src.nbytes, stream, "w")
            hv[e, sum(sizes[:part]):sum(sizes[:part + 1])] = src
        stream.synchronize("upload")
    x.upload(rng.standard_normal(E).astype(np.float32))
    cfg = SimpleNamespace(n_embd=E, n_ff_exp=Fn, n_expert_used=k, n_expert=n_expert)
    bank = kmoe.ExpertBank(DevMat(g, int(qt), Fn, E, rb, n_exp), 0, DevMat(u, int(qt), Fn, E, rb, n_exp), 0,
                           DevMat(d, int(qt), E, Fn, rbd, n_exp), 0, sizes)
    launches = []
    for i in range(sets):
        slots[i].upload(np.arange(i * k, (i + 1) * k, dtype=np.int32))      # expert ids: the table's rows
        launches += list(kmoe.expert_launches(K.fn("moe", "moe_gate_up"), K.fn("moe", "moe_down"), f"mapped {i}",
                                              cfg, jobs[i], bank, slots[i], x, h, out, ptab=ptab))
    vram = np.array([[b.ptr + e * sz for b, sz in zip((g, u, d), sizes)] for e in range(n_exp)], np.uint64)
    pinned = np.array([[host.dptr + e * blob + sum(sizes[:p]) for p in range(3)] for e in range(n_exp)], np.uint64)
    rows = []
    for misses in (0, 1, 2, 5, 10):
        tab = np.zeros((n_expert, 3), np.uint64)
        tab[:n_exp] = vram
        for i in range(sets):
            tab[i * k:i * k + misses] = pinned[i * k:i * k + misses]
        ptab.upload(tab)
        ms = graph_ms(f"mapped experts, {misses} misses", stream, launches) / sets
        mb = misses * blob / 1e6
        rows.append({"misses": misses, "ms_per_layer": ms, "mb_missed": mb,
                     "gbps_missed": mb / ms if misses else None})
        say(f"mapped experts: {misses:2d} of {k} from host memory: {ms * 1e3:7.1f} us a layer"
            + (f" ({mb:.1f} MB missed: {mb / ms:.1f} GB/s)" if misses else ""))
    host.free()
    A.free()
    stream.destroy()
    RESULTS["mapped"] = rows


def phase_bench(long_ctx: int) -> None:
    from strata.cuda.backend import CudaBackend
    from strata.inspect import per_token_bytes
    from strata.model.loader import load_model
    if not FLASH.exists():
        say(f"{FLASH} is missing: the model phase first")
        phase_model()
    t0 = time.time()
    model = load_model(FLASH)
    say(f"opened {FLASH.name} in {time.time() - t0:.1f}s; uploading every weight")
    be = CudaBackend(model, experts="vram", max_ctx=long_ctx + 256, log=say)
    res: dict = {"device": be.dev.name, "arena_gib": round(be.A.total / 2**30, 3), "notes": be.notes}
    try:
        nbytes = per_token_bytes(model)
        res["bytes_per_token"] = nbytes
        feed = Feeder(model)
        seq = be.new_seq()
        say("warm-up (5 tokens, excluded)")
        decode_ms(be, seq, feed, 5)
        short = decode_ms(be, seq, feed, 40)
        say(f"whole-token graph, positions 5-44: median {np.median(short):.3f} ms/token")
        prot = protocol_ms(be, seq, feed, 20)
        say(f"per-layer protocol (doorbell, host polls): median {np.median(prot):.3f} ms/token")
        stages = [be.timed_token(seq, *feed.next()) for _ in range(20)]
        per = defaultdict(float)
        for run in stages:
            for label, ms in run:
                per[label] += ms / len(stages)
        say(f"filling the context to {long_ctx} tokens")
        t1 = time.time()
        while seq.pos < long_ctx:
            be.launch_whole(*feed.step(seq))
            _wait(be.poll_logits)
        say(f"  {time.time() - t1:.1f}s")
        long = decode_ms(be, seq, feed, 40)
        say(f"whole-token graph, positions {long_ctx}+: median {np.median(long):.3f} ms/token")
        be.free_seq(seq)
        lat = be.measure_doorbell(500) * 1e6
    finally:
        be.close()
    total = nbytes["total"]
    res.update({
        "decode_ms_short": {"median": float(np.median(short)), "p90": float(np.percentile(short, 90)), "n": len(short)},
        "decode_ms_long": {"median": float(np.median(long)), "p90": float(np.percentile(long, 90)), "n": len(long),
                           "position": long_ctx},
        "protocol_ms": {"median": float(np.median(prot)), "p90": float(np.percentile(prot, 90)), "n": len(prot)},
        "stage_ms_mean": dict(per), "stage_ms_sum": float(sum(per.values())),
        "achieved_fraction_of_4.2TBps_short": total / (np.median(short) * 1e-3) / HBM_BPS,
        "achieved_fraction_of_4.2TBps_long": total / (np.median(long) * 1e-3) / HBM_BPS,
        "doorbell_us": {"median": float(np.median(lat)), "p90": float(np.percentile(lat, 90)), "n": len(lat)},
    })
    RESULTS["bench"] = res


# The ablate phase's kernel groups: launch names (less their "blk.N." prefix) left out of the whole-token graph.
ABLATE = {
    "write_rms": ("attn_write",),
    "moe_route": ("route",),
    "combine_write_rms": ("combine",),
    "up_mix": ("attn_up_mix", "ffn_up_mix"),
    "hc down (gemv_jobs)": ("attn_down_inject", "ffn_down_inject"),
    "shared expert (gemv_jobs, branch)": ("shexp_gate_up", "shexp_down"),
    "gdn_core": ("gdn_core",),
    "ssm_out + attn_output (gemv_jobs)": ("ssm_out", "attn_output"),
    "qsa_prep/score/select/combine": ("qsa_prep", "qsa_score", "qsa_select", "qsa_combine"),
    "write_rms + moe_route + combine": ("attn_write", "route", "combine"),
}


def phase_ablate() -> None:
    """What each kind of launch costs inside the whole-token graph: the graph re-captured without that kind's
    launches (the numbers it computes are then wrong; only its time is read), its ms against the full graph's in
    the same process, per launch left out. And the floor of a launch in such a graph: chains of 720 launches of a
    kernel that does almost nothing (one CTA, then 264), with programmatic dependent launch as in the token."""
    import re
    from strata.cuda.backend import CudaBackend
    from strata.cuda.launch import I, Launch, P
    from strata.model.loader import load_model
    if not FLASH.exists():
        phase_model()
    model = load_model(FLASH)
    be = CudaBackend(model, experts="vram", max_ctx=512, log=say)
    res: dict = {"device": be.dev.name, "rows": []}

    def timed(label: str, body) -> float:
        return graph_ms(label, be.stream, body=body, reps=30, warm=3)

    def kind(launch) -> str:
        return re.sub(r"^blk\.\d+\.", "", launch.name)

    try:
        feed = Feeder(model)
        seq = be.new_seq()
        decode_ms(be, seq, feed, 5)                     # a real position and step words in place, warm-up
        full = timed("token", be._enq_token)
        n_all = sum(len(ls) for stages in be.pre_tok + be.post for _, ls in stages)
        say(f"whole-token graph: {full:.3f} ms, {n_all} launches in the layers")
        res["full_ms"] = full
        kept = (be.pre_tok, be.post)
        for label, names in ABLATE.items():
            def drop(stages_list):
                return [[(st, [l for l in ls if kind(l) not in names]) for st, ls in stages]
                        for stages in stages_list]
            gone = sum(1 for stages in be.pre_tok + be.post for _, ls in stages for l in ls if kind(l) in names)
            be.pre_tok, be.post = drop(kept[0]), drop(kept[1])
            try:
                ms = timed("token less " + label, be._enq_token)
            finally:
                be.pre_tok, be.post = kept
            us = (full - ms) * 1e3 / max(gone, 1)
            say(f"  without {label:36s} ({gone:3d} launches): {ms:.3f} ms, {us:5.2f} us a launch")
            res["rows"].append({"kind": label, "launches": gone, "ms": ms, "us_per_launch": us})
        be.shared_on_branch = False
        try:
            ms = timed("token, shared expert inline", be._enq_token)
        finally:
            be.shared_on_branch = True
        say(f"  the shared expert on the main stream before the router, no branch: {ms:.3f} ms")
        res["shared_inline_ms"] = ms
        fn = be.kern.fn("gemv", "pdl_probe_b")
        for ctas in (1, 264):
            ls = [Launch(fn, "floor", (ctas,), (256,), 0, [P(be.b_xn), P(be.b_lo), I(1)]) for _ in range(720)]
            ms = timed(f"floor {ctas}", lambda ls=ls: [l.enqueue(be.stream) for l in ls])
            say(f"  a chain of 720 near-empty launches of {ctas} CTAs: {ms:.3f} ms, {ms / 720 * 1e3:.2f} us a launch")
            res[f"floor_{ctas}_us"] = ms / 720 * 1e3
        be.free_seq(seq)
    finally:
        be.close()
    RESULTS["ablate"] = res


def phase_overlap(misses: int = 4, reps: int = 20) -> None:
    """Whether reads of pinned host memory over PCIe overlap the all-VRAM whole-token graph's compute: a reader
    graph of 48 moe_fetch launches (one a layer, `misses` flash-sized experts each from mapped pinned memory into
    VRAM staging, as a mapped token's fetch or prefetch), timed alone and started together with the token's graph
    on another stream, with 2 x SMs CTAs (the fetch's grid) and 16 (the prefetch's), at normal and at the greatest
    stream priority. Medians of `reps` after 3. If the pair takes about the longer of the two, the PCIe reads hide
    behind compute; if about their sum, they do not, whatever the graph's branches."""
    from strata.cuda import driver as drv
    from strata.cuda.arena import Arena
    from strata.cuda.backend import CudaBackend
    from strata.cuda.graphs import Graph
    from strata.kernels import moe as kmoe
    from strata.model.loader import load_model
    if not FLASH.exists():
        phase_model()
    model = load_model(FLASH)
    be = CudaBackend(model, experts="vram", max_ctx=512, log=say)
    cfg, k, n_layer = be.cfg, be.cfg.n_expert_used, be.cfg.n_layer
    bk = be.banks[0]                             # an expert's gate, up and down bytes, as a blob holds them
    layout = kmoe.FetchLayout(bk.gate.n_out * bk.gate.row_bytes, bk.up.n_out * bk.up.row_bytes,
                              bk.down.n_out * bk.down.row_bytes)
    blob = layout.n_g + layout.n_u + layout.n_d
    n_blob = n_layer * misses
    res: dict = {"device": be.dev.name, "misses_per_launch": misses, "blob_bytes": blob, "rows": []}
    host = drv.HostBuffer(n_blob * layout.stride, mapped=True, what="overlap blobs")
    A = Arena()
    ptab = A.reserve("overlap ptab", (n_layer, cfg.n_expert, 3), np.uint64)
    ids = A.reserve("overlap ids", (k,), np.int32)
    eff = A.reserve("overlap eff", (k, 3), np.uint64)
    stage = A.reserve("overlap stage", (k * layout.stride,), np.uint8)
    A.commit()
    s2 = {False: drv.Stream(), True: drv.Stream(high_priority=True)}
    ev = [drv.Event(timing=True) for _ in range(3)]
    graphs: list = []
    try:
        hv = host.array(np.uint8, (n_blob, layout.stride))
        hv[:] = np.random.default_rng(5).integers(0, 256, hv.shape, dtype=np.uint8)
        ids.upload(np.arange(k, dtype=np.int32))
        tab = np.zeros((n_layer, cfg.n_expert, 3), np.uint64)
        tab[:, :, 0] = stage.ptr                 # in the device range [dev_lo, dev_hi): not copied
        for il in range(n_layer):
            for j in range(misses):
                b = host.dptr + (il * misses + j) * layout.stride
                tab[il, j] = (b, b + layout.off_u, b + layout.off_d)
        ptab.upload(tab)
        feed = Feeder(model)
        seq = be.new_seq()
        decode_ms(be, seq, feed, 5)
        tok = Graph("token", be.stream, be._enq_token)
        graphs.append(tok)

        def reader(ctas: int, stream) -> Graph:
            fn = be.kern.fn("moe", "moe_fetch")
            ls = [kmoe.fetch_launch(fn, f"overlap fetch {il}", cfg, ptab.row(il), ids, eff, stage, layout,
                                    A.base, A.base + A.total, ctas) for il in range(n_layer)]
            g = Graph(f"reader {ctas}", stream, lambda: [l.enqueue(stream) for l in ls])
            graphs.append(g)
            return g

        def alone(g, stream) -> float:
            for _ in range(3):
                g.launch(stream)
            stream.synchronize("overlap warm-up")
            t = []
            for _ in range(reps):
                ev[0].record(stream)
                g.launch(stream)
                ev[1].record(stream)
                ev[1].synchronize("overlap alone")
                t.append(ev[1].elapsed_ms(ev[0]))
            return float(np.median(t))

        def together(g, stream) -> tuple[float, float, float]:
            t = []
            for i in range(reps + 3):
                ev[0].record(be.stream)
                stream.wait(ev[0])
                tok.launch(be.stream)
                g.launch(stream)
                ev[1].record(be.stream)
                ev[2].record(stream)
                ev[1].synchronize("overlap token")
                ev[2].synchronize("overlap reader")
                a, b = ev[1].elapsed_ms(ev[0]), ev[2].elapsed_ms(ev[0])
                if i >= 3:
                    t.append((a, b, max(a, b)))
            return tuple(float(np.median([x[i] for x in t])) for i in range(3))

        t_tok = alone(tok, be.stream)
        say(f"overlap: token graph alone {t_tok:.3f} ms; reader: {n_layer} launches of {misses} experts "
            f"({n_blob * blob / 1e6:.1f} MB)")
        res["token_ms"] = t_tok
        for ctas, prio in ((2 * be.dev.n_sm, False), (16, False), (16, True), (2 * be.dev.n_sm, True)):
            g = reader(ctas, s2[prio])
            t_rd = alone(g, s2[prio])
            a, b, w = together(g, s2[prio])
            gbps = n_blob * blob / t_rd / 1e6
            say(f"  reader {ctas:3d} CTAs{' high priority' if prio else ''}: alone {t_rd:.3f} ms "
                f"({gbps:.1f} GB/s); with the token: token {a:.3f}, reader {b:.3f}, both {w:.3f} ms "
                f"(sum alone {t_tok + t_rd:.3f}, max {max(t_tok, t_rd):.3f})")
            res["rows"].append({"ctas": ctas, "high_priority": prio, "reader_ms": t_rd, "reader_gbps": gbps,
                                "token_with_ms": a, "reader_with_ms": b, "both_ms": w})
        be.free_seq(seq)
        # the readers did copy: the last launch's staging holds the last layer's blobs
        got = stage.download().reshape(k, layout.stride)
        for j in range(misses):
            want = hv[(n_layer - 1) * misses + j]
            for off, n in ((0, layout.n_g), (layout.off_u, layout.n_u), (layout.off_d, layout.n_d)):
                if not np.array_equal(got[j, off:off + n], want[off:off + n]):
                    raise SystemExit(f"overlap: staging slot {j} at {off} differs from its blob")
        say("  the last reader's staging equals its blobs")
    finally:
        for g in graphs:
            g.destroy()
        for e in ev:
            e.destroy()
        for s in s2.values():
            s.destroy()
        host.free()
        A.free()
        be.close()
    RESULTS["overlap"] = res


def phase_profile(tokens: int) -> None:
    from strata.cuda.backend import CudaBackend
    from strata.cuda.driver import check, cu
    from strata.model.loader import load_model
    if not FLASH.exists():
        phase_model()
    model = load_model(FLASH)
    be = CudaBackend(model, experts="vram", max_ctx=512, log=say)
    try:
        feed = Feeder(model)
        seq = be.new_seq()
        decode_ms(be, seq, feed, 5)                                   # warm-up, excluded
        ms = decode_ms(be, seq, feed, 20)
        say(f"whole-token graph, unprofiled: median {np.median(ms):.3f} ms/token over 20")
        RESULTS["profile"] = {"graph_ms_median": float(np.median(ms)), "tokens": tokens}
        check(cu.cuProfilerStart(), "cuProfilerStart")
        decode_ms(be, seq, feed, tokens)
        check(cu.cuProfilerStop(), "cuProfilerStop")
        be.free_seq(seq)
    finally:
        be.close()


def table() -> str:
    lines = []
    b = RESULTS.get("bench")
    if "tests" in RESULTS:
        lines.append(f"tests              exit {RESULTS['tests']['rc']} ({RESULTS['tests']['seconds']}s)")
    if "gemv" in RESULTS:
        lines.append(f"GEMV per launch ({RESULTS['gemv']['pdl']}; HBM ceiling 4.2 TB/s):")
        lines.append(f"  {'matrix':22s} {'type':7s} {'shape':17s} {'MB':>7s} {'us':>8s} {'GB/s':>7s} {'of 4.2':>6s} "
                     f"{'CTAs':>6s}")
        for r in RESULTS["gemv"]["rows"]:
            lines.append(f"  {r['label']:22s} {r['type']:7s} {r['shape']:17s} {r['mb']:7.2f} {r['us']:8.1f} "
                         f"{r['gbps']:7.0f} {r['gbps'] / 4200 * 100:5.0f}% {r['ctas']:6d}")
    if b:
        tb = b["bytes_per_token"]["total"]
        lines += [
            f"device             {b['device']}, arena {b['arena_gib']} GiB",
            f"bytes/token        {tb / 1e9:.3f} GB (floor at 4.2 TB/s: {tb / HBM_BPS * 1e3:.3f} ms)",
            f"decode short ctx   {b['decode_ms_short']['median']:.3f} ms/token (p90 {b['decode_ms_short']['p90']:.3f}),"
            f" {b['achieved_fraction_of_4.2TBps_short'] * 100:.1f}% of 4.2 TB/s",
            f"decode pos {b['decode_ms_long']['position']:<6d}  {b['decode_ms_long']['median']:.3f} ms/token "
            f"(p90 {b['decode_ms_long']['p90']:.3f}), {b['achieved_fraction_of_4.2TBps_long'] * 100:.1f}% of 4.2 TB/s",
            f"per-layer protocol {b['protocol_ms']['median']:.3f} ms/token (host wall clock)",
            f"doorbell           median {b['doorbell_us']['median']:.1f} us, p90 {b['doorbell_us']['p90']:.1f} us",
            "stages (mean ms/token over 20 tokens, one graph per stage; the parts sum to the total below):"]
        for label, ms in sorted(b["stage_ms_mean"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {label:22s} {ms:8.3f}")
        lines.append(f"  {'sum of the parts':22s} {b['stage_ms_sum']:8.3f}  (whole-token graph: "
                     f"{b['decode_ms_short']['median']:.3f}; the difference is the gaps between separate graphs)")
    return "\n".join(lines)


def main() -> None:
    global FLASH, ROUTING
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels-only", action="store_true", help="only pytest tests/test_cuda_kernels.py")
    ap.add_argument("--phases", default="tests,gemv,bench",
                    help="comma list of tests, gemv, qsa, gdn, moe, mapped, model, bench, profile, ablate, "
                         "overlap")
    ap.add_argument("--sweep", action="store_true", help="gemv phase: time every tile geometry of each matrix")
    ap.add_argument("--once", action="store_true",
                    help="gemv phase: each matrix's launch once, eagerly, untimed (run under ncu: bench/gpu_ncu.sh)")
    ap.add_argument("--expert-geom", default="",
                    help="every phase but tests (a pytest process of its own): the routed experts' tile geometry "
                         "as TPG,RR/TPG,RR (gate/up, down) in place of the time model's pick, to time the whole-token "
                         "graph with another tile size")
    ap.add_argument("--moe-rows", default="4096",
                    help="moe phase: the chunk's rows, a comma list (512: the 16-pair expert tiles)")
    ap.add_argument("--tokens", type=int, default=1, help="profile phase: whole-token graphs profiled")
    ap.add_argument("--long-ctx", type=int, default=2304, help="context filled before the long-context timing")
    ap.add_argument("--model", type=Path, default=FLASH,
                    help="the flash file of the model, bench and profile phases (made there when missing)")
    ap.add_argument("--routing", choices=("uniform", "realistic"), default=ROUTING,
                    help="make-model's routing when the model phase makes the file (every weight in VRAM: routing "
                         "changes which experts run, not how many)")
    a = ap.parse_args()
    FLASH, ROUTING = a.model.resolve(), a.routing
    if a.expert_geom:
        from strata.kernels import moe as kmoe
        from strata.kernels.gemv import CTA_THREADS, Geom
        try:
            pairs = [tuple(int(v) for v in part.split(",")) for part in a.expert_geom.split("/")]
        except ValueError:
            pairs = []
        if len(pairs) != 2 or any(len(p) != 2 or not 4 <= p[0] <= CTA_THREADS or p[0] & (p[0] - 1)
                                  or not 1 <= p[1] <= 4 for p in pairs):
            raise SystemExit(f"--expert-geom '{a.expert_geom}': give TPG,RR/TPG,RR (gate/up, down), TPG a power "
                             f"of 2 from 4 to {CTA_THREADS}, RR 1 to 4; e.g. 64,4/8,4")
        gs = tuple(Geom(tpg, rr, CTA_THREADS) for tpg, rr in pairs)
        kmoe.expert_geometry = lambda cfg, bank: gs
        say(f"routed experts' geometry: gate/up {gs[0].rows}-row tiles (tpg {gs[0].tpg}, rr {gs[0].rr}), "
            f"down {gs[1].rows}-row tiles (tpg {gs[1].tpg}, rr {gs[1].rr})")
    os.environ.setdefault("STRATA_CACHE", str(ROOT / ".cache"))
    phases = ["kernels"] if a.kernels_only else [p.strip() for p in a.phases.split(",") if p.strip()]
    try:
        for p in phases:
            t0 = time.time()
            say(f"phase {p}")
            if p == "kernels":
                phase_tests(["tests/test_cuda_kernels.py"])
            elif p == "tests":
                phase_tests(["tests/test_cuda_kernels.py", "tests/test_cuda_backend.py"])
            elif p == "ablate":
                phase_ablate()
            elif p == "gemv":
                phase_gemv(a.sweep, a.once)
            elif p == "qsa":
                phase_qsa()
            elif p == "gdn":
                phase_gdn()
            elif p == "ple":
                phase_ple()
            elif p == "mapped":
                phase_mapped()
            elif p == "moe":
                for rows in a.moe_rows.split(","):
                    phase_moe(int(rows))
            elif p == "model":
                phase_model()
            elif p == "bench":
                phase_bench(a.long_ctx)
            elif p == "profile":
                phase_profile(a.tokens)
            elif p == "overlap":
                phase_overlap()
            else:
                raise SystemExit(f"unknown phase '{p}': tests, gemv, qsa, gdn, ple, moe, mapped, model, bench, "
                                 "profile")
            say(f"phase {p} done in {time.time() - t0:.0f}s")
    finally:
        out = os.environ.get("OUT")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1, default=float))
        print("\n" + table(), flush=True)


if __name__ == "__main__":
    main()
