"""Strata next to llama.cpp on the same GGUF file, in the same run: decode and prefill speed, peak memory, floors.

    python bench/bench_vs_llamacpp.py --preset small --config cpu            # this 2-core machine
    python bench/bench_vs_llamacpp.py --preset flash --config vram           # GPU machine, all weights in VRAM
    python bench/bench_vs_llamacpp.py --preset flash --config budget24       # GPU, 24 GiB VRAM, experts in RAM

The file is made with `cli.py make-model` when missing (models/<preset>.gguf). Each engine runs each measurement
in its own child process, so peak host memory (VmHWM) is that engine's alone. Measurements, medians over
repeats with a warm-up excluded:
    prefill tok/s     a 512- and a 4096-token prompt
    decode tok/s      median per-token time of --decode tokens after a 1-token prompt (context 0) and after a
                      --long-ctx prompt (context 8K)
    N streams         CPU configuration, N in --streams: aggregate decode tok/s of N requests at once, each its
                      own 4-16-token prompt, then --stream-decode tokens. Strata: N `engine.generate` consumers
                      under one asyncio.gather; the tokens the streams got while all N were decoding (from the last
                      stream's first token to the first stream's last) over that window's length. llama.cpp: one
                      context with n_seq_max=N, the N prompts in one batch, then --stream-decode llama_decode calls
                      of one token (and its logits) per sequence, as llama-batched-bench and the server do:
                      N x steps over the steps' time (the tokens fed are fixed: which one does not change the work)
Strata's bytes moved per token come from `strata.inspect.per_token_bytes`; the floor they imply uses the host
memory read bandwidth measured in the same run (numpy sums, one thread per core). llama.cpp is llama-cpp-python 0.3.36 (its
sdist vendors llama.cpp with qwen4exp); the CPU configuration runs it through its Python bindings, the GPU
configurations through that llama.cpp's own `llama-bench` built for CUDA (--llama-bench PATH; the binary is not in
the repository). Peak memory of every child: its VmHWM (host) and the device's memory in use (NVML), polled while
it runs.

CPU configuration: strata reads every expert into its host store first (as budget24 does), then a 2-token warm-up;
each stream count's first round (4 tokens a stream) is a warm-up too, on both engines.
GPU configurations (strata: HostConfig.experts):
    vram      every weight in VRAM: strata's whole-token graph; llama.cpp -ngl 99
    budget24  strata: a 24 GiB VRAM budget (dense weights + expert cache), every expert preloaded into host memory,
              a warm-up request that fills the cache first; llama.cpp: -ngl 99 with --n-cpu-moe N (the experts of
              the first N layers in host memory), N from a sweep (--ncmoe), the fastest whose device memory stayed
              within 24 GiB
Strata prefills in steps of HostConfig.step_tokens (--step-tokens on the GPU; by default 4096 rows with every weight
in VRAM on the GPU, else 512) on both backends:
on the GPU a step of more than one row runs the batched path (strata.cuda.batch). --skip-strata names the
measurements not run for it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# the environment as the user gave it: importing strata sets OMP_WAIT_POLICY=passive for its own numba threads
# (strata.quant.experts), which would make llama.cpp's OpenMP threads sleep between its ops if a child inherited it
USER_ENV = dict(os.environ)


def host_bandwidth(gib: float = 2.0) -> float:
    """GB/s of numpy sums over a large array (read-bound), one slice per core on a thread pool, best of 3."""
    from concurrent.futures import ThreadPoolExecutor
    a = np.ones(int(gib * (1 << 30) / 8), np.int64)
    n = os.cpu_count() or 1
    parts = np.array_split(a, n)
    best = 0.0
    with ThreadPoolExecutor(n) as pool:
        for _ in range(3):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def tokens_for(n: int, n_vocab: int, eos: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    t = rng.integers(300, n_vocab - 300, n).tolist()       # plain tokens: no EOS, no specials
    return [x if x != eos else x + 1 for x in t]


def stream_prompts(n: int, n_vocab: int, eos: int) -> list[list[int]]:
    """The N-streams measurement's prompts, the same for both engines: 4 to 16 tokens, each its own."""
    return [tokens_for(4 + 3 * i % 13, n_vocab, eos, 10 + i) for i in range(n)]


# the median each measurement kind reports
KEY = {"decode": "decode_ms", "prefill": "prefill_tok_s", "streams": "agg_tok_s"}


# ---- the two engines, each in a child process ------------------------------------------------------------------
def strata_child(model: str, backend: str, runs: list, n_decode: int, vram_gib: float, experts: str = "auto",
                 preload: bool = False, warm_tokens: int = 2, stream_decode: int = 0,
                 stream_experts: str = "auto", map_experts: str = "auto", step_tokens: int | None = None,
                 promote_per_layer: int | None = None, cache_half_life: int | None = None,
                 mapped_reads: str = "prefetch", prefetch_extra: int = 0) -> dict:
    """One engine open (and expert preload) for a list of measurements [kind, n]: n the prompt's length, each a
    fresh request, or (kind "streams") n requests at once; a stream count's first round is a warm-up, excluded."""
    import asyncio
    from strata.engine import Engine, HostConfig
    from strata.sampling import SamplingParams

    async def streams(eng, n: int, n_tokens: int) -> dict:
        async def one(prompt: list[int]) -> np.ndarray:
            stamps = []
            async for ch in eng.generate(prompt, SamplingParams(max_tokens=n_tokens, stop_at_eos=False)):
                if ch.token is not None:                    # the last chunk is the finish marker
                    stamps.append(time.perf_counter())
            return np.array(stamps)
        got = await asyncio.gather(*map(one, stream_prompts(n, eng.cfg.n_vocab, eng.cfg.eos_id or -1)))
        t0, t1 = max(s[0] for s in got), min(s[-1] for s in got)     # the window where all n were decoding
        inside = sum(int(np.count_nonzero((s > t0) & (s <= t1))) for s in got)
        return {"agg_tok_s": inside / float(t1 - t0) if t1 > t0 else float("nan")}   # nan: they never overlapped

    import tempfile

    from strata.host.trace import format_summary, last_request, load, summarize
    trace = tempfile.NamedTemporaryFile(prefix="strata-bench-", suffix=".jsonl", delete=False).name

    def decode_trace() -> str:
        """Where the last request's decode steps went (the trace's table, means per step; its finish is a span)."""
        return format_summary([p for p in summarize(last_request(load(trace))) if p.phase == "decode"])

    async def go():
        max_ctx = -(-(max(max(n for _, n in runs) + n_decode, 16 + stream_decode) + 8) // 1024) * 1024
        eng = await Engine.open(model, backend=backend, trace=trace, host=HostConfig(
            vram_budget_bytes=int(vram_gib * (1 << 30)), experts=experts, max_ctx=max_ctx,
            stream_experts=stream_experts, map_experts=map_experts, mapped_reads=mapped_reads,
            prefetch_extra=prefetch_extra, step_tokens=step_tokens,
            promote_per_layer=promote_per_layer, **({} if cache_half_life is None else {"cache_half_life": cache_half_life}),
            prefix_cache_bytes=0))      # the prompts share prefixes (one seed): each must be computed, not resumed
        cfg = eng.cfg
        if preload:
            await eng.preload_experts()
        warm = SamplingParams(max_tokens=warm_tokens, stop_at_eos=False)
        async for _ in eng.generate(tokens_for(4, cfg.n_vocab, cfg.eos_id or -1, 2), warm):
            pass
        out, warmed = [], set()
        for kind, n in runs:
            if kind == "streams":
                if n not in warmed:
                    await streams(eng, n, 4)
                    warmed.add(n)
                r = await streams(eng, n, stream_decode)
            else:
                prompt = tokens_for(n, cfg.n_vocab, cfg.eos_id or -1, 1)
                params = SamplingParams(max_tokens=n_decode if kind == "decode" else 1, stop_at_eos=False)
                stamps = []
                modes, dmodes = dict(eng.scheduler.chunk_modes), dict(eng.scheduler.decode_modes)
                cache = eng.scheduler.cache
                hits0, looks0 = sum(cache.hits.values()), sum(cache.lookups.values())
                t0 = time.perf_counter()
                async for _ in eng.generate(prompt, params):
                    stamps.append(time.perf_counter())
                r = {"prefill_tok_s": n / (stamps[0] - t0)}
                r["chunks"] = {m: c - modes.get(m, 0) for m, c in eng.scheduler.chunk_modes.items()
                               if c > modes.get(m, 0)}           # the prompt's chunks: streamed or split
                r["rows"] = {m: c - dmodes.get(m, 0) for m, c in eng.scheduler.decode_modes.items()
                             if c > dmodes.get(m, 0)}            # its one-row steps: mapped or split
                if kind == "decode":     # the last chunk: the finish marker
                    r["decode_ms"] = float(np.median(np.diff(stamps[:-1])) * 1e3)
                    eng.flush_trace()
                    print(f"strata decode {n}, the request's trace:\n{decode_trace()}", file=sys.stderr, flush=True)
                looks = sum(cache.lookups.values()) - looks0
                if looks:                # the request's VRAM cache hit rate (prompt and decode rows)
                    r["vram_hits"] = round((sum(cache.hits.values()) - hits0) / looks, 4)
            print(f"strata {kind} {n}: {r}", file=sys.stderr, flush=True)
            out.append(r)
        await eng.aclose()
        os.unlink(trace)
        return out

    return {"runs": asyncio.run(go())}


def strata_measure(spec: dict, jobs: list, timeout: float) -> dict:
    """jobs [(label, kind, n, repeats)] in one strata child: {label: {key: median, peak_rss_gib, peak_dev_gib}} or
    {label: {"error": ...}}; the peaks are the child's, shared by its measurements."""
    runs = [[kind, n] for _, kind, n, reps in jobs for _ in range(reps)]
    res = run_child(dict(spec, runs=runs), timeout, show_err=True)
    out, i = {}, 0
    for label, kind, n, reps in jobs:
        if "error" in res:
            out[label] = {"error": res["error"]}
            continue
        mine, i = res["runs"][i:i + reps], i + reps
        key = KEY[kind]
        out[label] = {key: float(np.median([r[key] for r in mine])), "peak_rss_gib": res["peak_rss_gib"],
                      "peak_dev_gib": res.get("peak_dev_gib", float("nan"))}
    return out


def llama_child(model: str, kind: str, n_prompt: int, n_decode: int, threads: int, gpu_layers: int) -> dict:
    from llama_cpp import Llama
    llm = Llama(model_path=model, n_ctx=n_prompt + n_decode + 16, n_batch=512, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, n_gpu_layers=gpu_layers, verbose=False, logits_all=False)
    n_vocab, eos = llm.n_vocab(), llm.token_eos()
    llm.eval(tokens_for(4, n_vocab, eos, 2))               # warm-up, excluded
    llm.reset()
    prompt = tokens_for(n_prompt, n_vocab, eos, 1)
    t0 = time.perf_counter()
    llm.eval(prompt)
    out = {"prefill_tok_s": n_prompt / (time.perf_counter() - t0)}
    if kind == "decode":
        # which token is fed does not change the work; fixed tokens spare reading logits back
        dt = []
        for tok in tokens_for(n_decode, n_vocab, eos, 3):
            t = time.perf_counter()
            llm.eval([tok])
            dt.append(time.perf_counter() - t)
        out["decode_ms"] = float(np.median(dt) * 1e3)
    return out


def llama_streams_child(model: str, n_streams: int, n_decode: int, repeats: int, threads: int) -> dict:
    """N streams through llama.cpp's C API: one context with n_seq_max=N, every llama_decode call one token for
    each sequence. A warm-up round of 4 steps, then `repeats` rounds from a cleared memory: {agg_tok_s: median}."""
    import llama_cpp as lc
    from llama_cpp._logger import set_verbose
    set_verbose(False)                                      # errors only, as Llama(verbose=False) does it
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = 0
    mdl = lc.llama_model_load_from_file(model.encode(), mp)
    if not mdl:
        raise RuntimeError(f"llama.cpp could not load {model}")
    vocab = lc.llama_model_get_vocab(mdl)
    prompts = stream_prompts(n_streams, lc.llama_vocab_n_tokens(vocab), lc.llama_vocab_eos(vocab))
    n_prompt = sum(map(len, prompts))
    cp = lc.llama_context_default_params()
    # not unified: each sequence its own n_ctx / n_seq_max cells (the default; no shared prefix to gain from)
    cp.n_seq_max, cp.n_ctx = n_streams, n_streams * -(-(16 + n_decode + 8) // 256) * 256
    cp.n_batch = cp.n_ubatch = max(512, n_prompt)
    cp.n_threads = cp.n_threads_batch = threads
    ctx = lc.llama_init_from_model(mdl, cp)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not make a context of {n_streams} sequences")
    batch = lc.llama_batch_init(cp.n_batch, 0, 1)

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, pos, seq, logits) items."""
        batch.n_tokens = len(items)
        for j, (tok, pos, seq, logits) in enumerate(items):
            batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = tok, pos, 1, logits
            batch.seq_id[j][0] = seq
        if (rc := lc.llama_decode(ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def round_(steps: int) -> float:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        decode([(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)])
        tok = prompts[0][0]
        t0 = time.perf_counter()
        for k in range(steps):
            decode([(tok, len(p) + k, s, True) for s, p in enumerate(prompts)])
        lc.llama_synchronize(ctx)
        return n_streams * steps / (time.perf_counter() - t0)

    round_(4)
    runs = [round_(n_decode) for _ in range(repeats)]
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(mdl)
    return {"agg_tok_s": float(np.median(runs)), "runs": runs}


def child_main(spec: dict) -> None:
    engine = spec.pop("engine")
    fn = {"strata": strata_child, "floors": gpu_memory_floors, "llama": llama_child,
          "llama_streams": llama_streams_child}[engine]
    res = fn(**spec)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so it would include the parent's peak
    hwm = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
    res["peak_rss_gib"] = int(hwm.split()[1]) / (1 << 20)
    print("RESULT " + json.dumps(res), flush=True)


class Peak:
    """Polls a child while it runs: its VmHWM (peak resident host memory) and the device memory in use (NVML, the
    whole GPU: nothing else runs on it during the bench)."""

    def __init__(self, pid: int, period: float = 0.1):
        import threading
        self.pid, self.host_kib, self.dev_bytes = pid, 0, 0
        self._nvml = None
        try:
            import pynvml                                   # nvidia-ml-py; absent on CPU machines
            pynvml.nvmlInit()
            self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(0))
        except Exception:
            pass
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._t.start()

    def _run(self, period: float) -> None:
        while not self._stop.is_set():
            try:
                for ln in open(f"/proc/{self.pid}/status"):
                    if ln.startswith("VmHWM:"):
                        self.host_kib = max(self.host_kib, int(ln.split()[1]))
            except OSError:
                pass
            if self._nvml:
                nv, h = self._nvml
                self.dev_bytes = max(self.dev_bytes, int(nv.nvmlDeviceGetMemoryInfo(h).used))
            self._stop.wait(period)

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        return {"peak_rss_gib": self.host_kib / (1 << 20), "peak_dev_gib": self.dev_bytes / (1 << 30)}


def run_polled(cmd: list[str], timeout: float, show_err: bool = False) -> tuple[int, str, str, dict]:
    """show_err: the child's stderr goes straight to ours (its progress in the log as it runs), else captured."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None if show_err else subprocess.PIPE, text=True,
                            env=USER_ENV)
    peak = Peak(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err = (err or "") + f"\ntimed out after {timeout:.0f} s"
    return proc.returncode, out, err, peak.stop()


def run_child(spec: dict, timeout: float, show_err: bool = False) -> dict:
    rc, out, err, peak = run_polled([sys.executable, __file__, "--child", json.dumps(spec)], timeout, show_err)
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    if rc != 0 or line is None:
        why = (err or out or "").strip().splitlines()[-1:] or [f"exit status {rc}"]
        return {"error": why + (["(its stderr is above)"] if show_err else [])}
    res = json.loads(line[7:])           # peak_rss_gib: the child's own VmHWM, read at its end
    res["peak_dev_gib"] = peak["peak_dev_gib"]
    return res


def llama_bench(binary: str, model: str, args: list[str], timeout: float) -> tuple[list[dict], dict]:
    """One llama-bench run (-o json): per test {n_prompt, n_gen, n_depth, tok_s (median of the repetitions)}."""
    cmd = [binary, "-m", model, "-o", "json", *args]
    print("# " + " ".join(cmd[:1] + ["-m", Path(model).name] + cmd[3:]), flush=True)
    rc, out, err, peak = run_polled(cmd, timeout)
    if rc != 0:
        raise RuntimeError(f"llama-bench failed ({rc}): {err.strip().splitlines()[-3:]}")
    res = [{"n_prompt": r["n_prompt"], "n_gen": r["n_gen"], "n_depth": r.get("n_depth", 0),
            "tok_s": float(np.median(r["samples_ts"])), "n_cpu_moe": r.get("n_cpu_moe", 0)}
           for r in json.loads(out)]
    for r in res:              # as they come: a run cut short by a time limit keeps what finished
        print(f"# llama.cpp: prompt {r['n_prompt']}, gen {r['n_gen']}, depth {r['n_depth']}: {r['tok_s']:.2f} tok/s, "
              f"peak device {peak.get('peak_dev_gib', 0):.2f} GiB", flush=True)
    return res, peak


def gpu_memory_floors() -> dict:
    """HBM (device copy) and PCIe host-to-device (pinned) bandwidth in GB/s, measured now with cuda-bindings."""
    from strata.cuda import driver as drv
    from strata.cuda.driver import check, cu
    drv.Device.open()                                       # the primary context, current on this thread
    n = 1 << 30
    a = int(check(cu.cuMemAlloc(n), "cuMemAlloc"))
    b = int(check(cu.cuMemAlloc(n), "cuMemAlloc"))
    h = drv.HostBuffer(n // 4, what="bandwidth probe")
    st = drv.Stream()
    e0, e1 = drv.Event(timing=True), drv.Event(timing=True)

    def timed(fn, reps=5) -> float:
        ts = []
        for _ in range(reps + 1):
            e0.record(st)
            fn()
            e1.record(st)
            e1.synchronize("bandwidth probe")
            ts.append(e1.elapsed_ms(e0) / 1e3)
        return float(np.median(ts[1:]))
    hbm = 2 * n / timed(lambda: check(cu.cuMemcpyDtoDAsync(b, a, n, st.handle), "cuMemcpyDtoDAsync")) / 1e9
    pcie = (n // 4) / timed(lambda: drv.memcpy_htod_async(a, h.ptr, n // 4, st, "probe")) / 1e9
    for p in (a, b):
        cu.cuMemFree(p)
    h.free()
    return {"hbm": hbm, "pcie": pcie}


# ---- the run ---------------------------------------------------------------------------------------------------
def main() -> None:
    from strata.host.backend import MAPPED_READS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--preset", default="small")
    p.add_argument("--model", help="use this file instead of making models/<preset>.gguf")
    p.add_argument("--config", default="cpu", choices=["cpu", "vram", "budget24"])
    p.add_argument("--decode", type=int, default=16, help="decode tokens per measurement (median per token)")
    p.add_argument("--long-ctx", type=int, default=8192)
    p.add_argument("--prefill", default="512,4096")
    p.add_argument("--repeats", type=int, default=3, help="repeats of each prefill and streams "
                   "measurement (median)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--llama-bench", help="GPU configurations: llama.cpp's llama-bench binary built for CUDA")
    p.add_argument("--ncmoe", default="48,40,32,28,24", help="budget24: the --n-cpu-moe values swept")
    p.add_argument("--step-tokens", type=int, default=None,
                   help="strata's HostConfig.step_tokens on the GPU configurations: rows a prompt step carries at most "
                        "(default: the engine's, 4096) "
                        "(under the 24 GiB budget a chunk's expert streaming is the same for any length, so longer "
                        "chunks amortize it; their activations, 5.8 GB at 4096 rows for flash, are cache slots "
                        "between batched steps)")
    p.add_argument("--map-experts", default="auto", choices=["auto", "always", "never"],
                   help="budget24: strata's HostConfig.map_experts (decode rows as one graph, misses read from host "
                        "memory)")
    p.add_argument("--mapped-reads", default="prefetch", choices=list(MAPPED_READS),
                   help="budget24: strata's HostConfig.mapped_reads (a mapped token's misses fetched into VRAM by "
                        "every SM first, with the next layer's predicted ones a layer early, or read over PCIe by the "
                        "expert kernels)")
    p.add_argument("--prefetch-extra", type=int, default=0,
                   help="budget24: strata's HostConfig.prefetch_extra (experts a prefetch's prediction keeps beyond "
                        "the top k)")
    p.add_argument("--stream-experts", default="auto", choices=["auto", "always", "never"],
                   help="budget24: strata's HostConfig.stream_experts (how prompt chunks get their experts)")
    p.add_argument("--promote-per-layer", type=int, default=None, metavar="N",
                   help="budget24: strata's HostConfig.promote_per_layer (a mapped token's misses promoted into the "
                        "VRAM cache a layer; default: all)")
    p.add_argument("--cache-half-life", type=int, default=None, metavar="TOKENS",
                   help="budget24: strata's HostConfig.cache_half_life (the half-life of the routes the VRAM cache "
                        "ranks experts by; default: the engine's)")
    p.add_argument("--skip-strata", default="", help="comma list of measurement labels not run for strata")
    p.add_argument("--skip-llama", action="store_true", help="strata's cells only (on the GPU: llama.cpp's were "
                   "measured by an earlier call on the same machine)")
    p.add_argument("--streams", default="1,2,4,8", help="cpu: the concurrent stream counts of aggregate decode")
    p.add_argument("--stream-decode", type=int, default=64, help="cpu: decode tokens per stream (enough "
                   "that all the streams decode at once for a while)")
    a = p.parse_args()
    if a.child:
        return child_main(json.loads(a.child))

    if a.model and not Path(a.model).exists():
        p.error(f"--model {a.model}: no such file (cli.py make-model writes one; without --model the bench makes "
                f"models/<preset>.gguf)")
    model = a.model or str(ROOT / "models" / f"{a.preset}.gguf")
    if not Path(model).exists():
        Path(model).parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(ROOT / "cli.py"), "make-model", "--preset", a.preset, model], check=True)
    from strata.inspect import per_token_bytes
    from strata.model.loader import load_model
    m = load_model(model)
    ptb = per_token_bytes(m)
    bw = host_bandwidth()
    # "+changes" when the tracked files differ from HEAD: a copy of a working tree (the GPU machine's) may carry an
    # older .git than its files, and the bare commit would name a tree that did not run
    git = lambda *args: subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()
    commit = os.environ.get("STRATA_COMMIT") or (git("rev-parse", "--short", "HEAD")
                                                 + ("+changes" if git("status", "--porcelain", "-uno") else ""))
    print(f"# {a.config} | model {Path(model).name} ({m.file.size / 2**30:.2f} GiB) | {platform.processor() or ''} "
          f"{os.cpu_count()} cores | {time.strftime('%Y-%m-%d')} | commit {commit}")
    print(f"# host read bandwidth {bw:.1f} GB/s; strata bytes/token {ptb['total'] / 2**20:.1f} MiB -> floor "
          f"{ptb['total'] / bw / 1e6:.2f} ms/token from host memory", flush=True)

    pre = [(f"prefill {n}", "prefill", int(n)) for n in a.prefill.split(",")]
    dec = [("decode ctx 0", "decode", 1), (f"decode ctx {a.long_ctx}", "decode", a.long_ctx)]
    if a.config != "cpu":
        return gpu_run(a, model, ptb, bw, dec + pre)
    cpu_run(a, model, pre + dec + [(f"{n}-stream aggregate decode", "streams", int(n)) for n in a.streams.split(",")])


def cpu_run(a, model: str, jobs: list) -> None:
    """The cpu configuration: strata (one child) next to llama.cpp's Python bindings (a child per run), one table."""
    skip = {x.strip() for x in a.skip_strata.split(",") if x.strip()}
    # a decode measurement is already the median of --decode tokens
    reps = {label: 1 if kind == "decode" else a.repeats for label, kind, n in jobs}
    # every expert read into the host store first, as on the GPU: the measurements see a warm engine (llama.cpp's
    # mapping is warm after its own warm-up: the file is in the page cache)
    mine = [(label, kind, n, reps[label]) for label, kind, n in jobs if label not in skip]
    strata = strata_measure(dict(engine="strata", model=model, backend="cpu", n_decode=a.decode, vram_gib=1e6,
                                 preload=True, stream_decode=a.stream_decode), mine, a.timeout) if mine else {}
    print("| measurement | strata tok/s | llama.cpp tok/s | strata/llama.cpp | strata peak RSS GiB | "
          "llama.cpp peak RSS GiB |")
    print("|---|---|---|---|---|---|", flush=True)
    rate = {}                                   # (engine, label): tok/s, for the streams' scaling line
    for label, kind, n in jobs:
        key = KEY[kind]
        if a.skip_llama:
            ll = None
        elif kind == "streams":                 # its repeats inside the one child, after a warm-up round
            ll = run_child(dict(engine="llama_streams", model=model, n_streams=n, n_decode=a.stream_decode,
                                repeats=reps[label], threads=a.threads), a.timeout)
        else:
            runs = [run_child(dict(engine="llama", model=model, kind=kind, n_prompt=n, n_decode=a.decode,
                                   threads=a.threads, gpu_layers=0), a.timeout) for _ in range(reps[label])]
            ok = [r for r in runs if "error" not in r]
            ll = ({key: float(np.median([r[key] for r in ok])), "peak_rss_gib": max(r["peak_rss_gib"] for r in ok)}
                  if ok else {"error": runs[0]["error"]})
        cells = []
        for eng, r in (("strata", strata.get(label)), ("llama.cpp", ll)):
            if r is None or "error" in r:
                cells.append(("not run" if r is None else f"error: {r['error']}", "-"))
                continue
            rate[eng, label] = 1e3 / r[key] if kind == "decode" else r[key]
            cells.append((f"{rate[eng, label]:.2f}", f"{r['peak_rss_gib']:.2f}"))
        ratio = (f"{rate['strata', label] / rate['llama.cpp', label]:.3f}"
                 if ("strata", label) in rate and ("llama.cpp", label) in rate else "-")
        print(f"| {label} | {cells[0][0]} | {cells[1][0]} | {ratio} | {cells[0][1]} | {cells[1][1]} |", flush=True)
    streams = [(label, n) for label, kind, n in jobs if kind == "streams"]
    for eng in ("strata", "llama.cpp"):
        if streams and (eng, streams[0][0]) in rate:      # the goal: 4 streams >= 2.5x one
            base = rate[eng, streams[0][0]]
            print(f"# {eng} aggregate decode relative to {streams[0][1]} stream(s): " + ", ".join(
                f"{n} streams {rate[eng, label] / base:.2f}x" for label, n in streams[1:] if (eng, label) in rate),
                flush=True)


def gpu_run(a, model: str, ptb: dict, host_bw: float, jobs: list) -> None:
    """The vram and budget24 configurations: strata (children) next to llama-bench, one table."""
    if not a.llama_bench and not a.skip_llama:
        sys.exit("the GPU configurations need --llama-bench PATH (llama.cpp's llama-bench built for CUDA), or "
                 "--skip-llama")
    fl = run_child({"engine": "floors"}, 300)
    if "error" in fl:
        sys.exit(f"measuring the GPU's bandwidths failed: {fl['error']}")
    routed = ptb.get("routed experts", 0)
    print(f"# HBM copy {fl['hbm']:.0f} GB/s, PCIe host->device (pinned) {fl['pcie']:.1f} GB/s, host read "
          f"{host_bw:.1f} GB/s; bytes/token {ptb['total'] / 1e9:.3f} GB -> HBM floor "
          f"{ptb['total'] / fl['hbm'] / 1e6:.3f} ms/token; routed experts {routed / 1e6:.0f} MB/token -> "
          f"{routed / fl['pcie'] / 1e6:.2f} ms over PCIe or {routed / host_bw / 1e6:.2f} ms from host memory if "
          f"every one missed the VRAM cache", flush=True)
    budget = a.config == "budget24"
    base = ["-ngl", "99", "-t", str(a.threads)]
    ll: dict[str, tuple[float, dict]] = {}
    if not a.skip_llama:
        ll = llama_cells(a, model, jobs, base, budget)
    strata_cells(a, model, jobs, ll, budget)


def llama_cells(a, model: str, jobs: list, base: list, budget: bool) -> dict:
    """llama-bench's cells {label: (tok/s, peak memory)}; budget24: the --n-cpu-moe sweep first."""
    if budget:          # the sweep: the fastest --n-cpu-moe whose device memory stayed within 24 GiB
        sweep = []
        for n in [int(x) for x in a.ncmoe.split(",")]:
            try:
                res, peak = llama_bench(a.llama_bench, model, base + ["-ncmoe", str(n), "-p", "0", "-n",
                                                                      str(a.decode), "-r", "2"], a.timeout)
            except RuntimeError as e:
                print(f"# --n-cpu-moe {n}: {e}", flush=True)
                continue
            sweep.append((n, res[0]["tok_s"], peak["peak_dev_gib"]))
            print(f"# --n-cpu-moe {n}: decode {res[0]['tok_s']:.2f} tok/s, device memory {peak['peak_dev_gib']:.2f} "
                  f"GiB", flush=True)
        fits = [x for x in sweep if x[2] <= 24.0]
        if not fits:
            sys.exit("no --n-cpu-moe setting kept llama.cpp within 24 GiB")
        best = max(fits, key=lambda x: x[1])
        print(f"# llama.cpp setting: --n-cpu-moe {best[0]} ({best[2]:.2f} GiB)", flush=True)
        base += ["-ncmoe", str(best[0])]
    ll = {}
    pre = [n for _, kind, n in jobs if kind == "prefill"]
    res, peak = llama_bench(a.llama_bench, model, base + ["-p", ",".join(map(str, pre)), "-n", "0", "-r",
                                                          str(a.repeats)], a.timeout)
    for r in res:
        ll[f"prefill {r['n_prompt']}"] = (r["tok_s"], peak)
    depths = sorted({0 if n == 1 else n for _, kind, n in jobs if kind == "decode"})
    res, peak = llama_bench(a.llama_bench, model, base + ["-p", "0", "-n", str(a.decode), "-d",
                                                          ",".join(map(str, depths)), "-r", str(a.repeats)],
                            a.timeout)
    for r in res:
        ll[f"decode ctx {r['n_depth']}"] = (r["tok_s"], peak)
    return ll


def strata_cells(a, model: str, jobs: list, ll: dict, budget: bool) -> None:
    """Strata's measurements (all in one child: one engine open and expert preload) and the table."""
    skip = {x.strip() for x in a.skip_strata.split(",") if x.strip()}
    spec = dict(engine="strata", model=model, backend="cuda", n_decode=a.decode, vram_gib=24.0 if budget else 130.0,
                experts="host" if budget else "vram", preload=budget, warm_tokens=48 if budget else 2,
                stream_experts=a.stream_experts, map_experts=a.map_experts, step_tokens=a.step_tokens,
                promote_per_layer=a.promote_per_layer, cache_half_life=a.cache_half_life, mapped_reads=a.mapped_reads,
                prefetch_extra=a.prefetch_extra)
    mine = [(label, kind, n, 1 if kind == "decode" or n > 1024 else a.repeats)
            for label, kind, n in jobs if label not in skip]
    strata = strata_measure(spec, mine, a.timeout) if mine else {}
    print("| measurement | strata tok/s | llama.cpp tok/s | strata/llama.cpp | strata peak host / device GiB | "
          "llama.cpp peak host / device GiB |")
    print("|---|---|---|---|---|---|", flush=True)
    nan = float("nan")
    for label, kind, n in jobs:
        tl, lpeak = ll.get(label, (nan, {"peak_rss_gib": nan, "peak_dev_gib": nan}))
        lcell = "not run" if a.skip_llama else f"{tl:.2f}"
        lmem = "-" if a.skip_llama else f"{lpeak['peak_rss_gib']:.2f} / {lpeak['peak_dev_gib']:.2f}"
        s = strata.get(label)
        if s is None or "error" in s:
            print(f"| {label} | {'not run' if s is None else 'error: ' + str(s['error'])} | {lcell} | - | - | "
                  f"{lmem} |", flush=True)
            continue
        ts = 1e3 / s["decode_ms"] if kind == "decode" else s["prefill_tok_s"]
        ratio = "-" if a.skip_llama else f"{ts / tl:.3f}"
        print(f"| {label} | {ts:.2f} | {lcell} | {ratio} | {s['peak_rss_gib']:.2f} / {s['peak_dev_gib']:.2f} | "
              f"{lmem} |", flush=True)

if __name__ == "__main__":
    main()
