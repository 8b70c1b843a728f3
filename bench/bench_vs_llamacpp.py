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
Strata's bytes moved per token come from `strata.inspect.per_token_bytes`; the floor they imply uses the host
memory read bandwidth measured in the same run (numpy, all threads). llama.cpp is llama-cpp-python 0.3.36 (its
sdist vendors llama.cpp with qwen4exp); the CPU configuration runs it through its Python bindings.
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


def host_bandwidth(gib: float = 2.0) -> float:
    """GB/s of a numpy sum over a large array (read-bound), best of 3."""
    a = np.ones(int(gib * (1 << 30) / 8), np.int64)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        a.sum()
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def tokens_for(n: int, n_vocab: int, eos: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    t = rng.integers(300, n_vocab - 300, n).tolist()       # plain tokens: no EOS, no specials
    return [x if x != eos else x + 1 for x in t]


# ---- the two engines, each in a child process ------------------------------------------------------------------
def strata_child(model: str, backend: str, kind: str, n_prompt: int, n_decode: int, vram_gib: float) -> dict:
    import asyncio
    from strata.engine import Engine, HostConfig
    from strata.sampling import SamplingParams

    async def go():
        eng = await Engine.open(model, backend=backend,
                                host=HostConfig(vram_budget_bytes=int(vram_gib * (1 << 30))))
        cfg = eng.cfg
        prompt = tokens_for(n_prompt, cfg.n_vocab, cfg.eos_id or -1, 1)
        warm = SamplingParams(max_tokens=2, stop_at_eos=False)
        async for _ in eng.generate(tokens_for(4, cfg.n_vocab, cfg.eos_id or -1, 2), warm):
            pass
        stamps, t_prompt_done = [], None
        params = SamplingParams(max_tokens=n_decode if kind == "decode" else 1, stop_at_eos=False)
        t0 = time.perf_counter()
        async for c in eng.generate(prompt, params):
            now = time.perf_counter()
            if t_prompt_done is None:
                t_prompt_done = now
            stamps.append(now)
        await eng.aclose()
        return t0, t_prompt_done, stamps

    t0, t_prompt, stamps = asyncio.run(go())
    out = {"prefill_tok_s": n_prompt / (t_prompt - t0)}
    if kind == "decode":
        dt = np.diff(stamps[:-1])                  # the last chunk is the finish marker
        out["decode_ms"] = float(np.median(dt) * 1e3)
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


def child_main(spec: dict) -> None:
    fn = strata_child if spec.pop("engine") == "strata" else llama_child
    res = fn(**spec)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so it would include the parent's peak
    hwm = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
    res["peak_rss_gib"] = int(hwm.split()[1]) / (1 << 20)
    print("RESULT " + json.dumps(res), flush=True)


def run_child(spec: dict, timeout: float) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                       timeout=timeout)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(line[7:])


# ---- the run ---------------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--preset", default="small")
    p.add_argument("--model", help="use this file instead of making models/<preset>.gguf")
    p.add_argument("--config", default="cpu", choices=["cpu", "vram", "budget24"])
    p.add_argument("--decode", type=int, default=16, help="decode tokens per measurement (median per token)")
    p.add_argument("--long-ctx", type=int, default=8192)
    p.add_argument("--prefill", default="512,4096")
    p.add_argument("--repeats", type=int, default=3, help="repeats of each prefill measurement (median)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--timeout", type=float, default=3600)
    a = p.parse_args()
    if a.child:
        return child_main(json.loads(a.child))

    model = a.model or str(ROOT / "models" / f"{a.preset}.gguf")
    if not Path(model).exists():
        Path(model).parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(ROOT / "cli.py"), "make-model", "--preset", a.preset, model], check=True)
    from strata.inspect import per_token_bytes
    from strata.model.loader import load_model
    m = load_model(model)
    ptb = per_token_bytes(m)
    bw = host_bandwidth()
    backend = "cpu" if a.config == "cpu" else "cuda"
    vram = 24.0 if a.config == "budget24" else 1e6
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"# {a.config} | model {Path(model).name} ({m.file.size / 2**30:.2f} GiB) | {platform.processor() or ''} "
          f"{os.cpu_count()} cores | {time.strftime('%Y-%m-%d')} | commit {commit}")
    print(f"# host read bandwidth {bw:.1f} GB/s; strata bytes/token {ptb['total'] / 2**20:.1f} MiB -> floor "
          f"{ptb['total'] / bw / 1e6:.2f} ms/token from host memory", flush=True)

    rows = []
    jobs = [("decode ctx 0", "decode", 1), (f"decode ctx {a.long_ctx}", "decode", a.long_ctx)]
    jobs += [(f"prefill {n}", "prefill", int(n)) for n in a.prefill.split(",")]
    for label, kind, n in jobs:
        reps = 1 if kind == "decode" else a.repeats
        res = {}
        for eng in ("strata", "llama.cpp"):
            runs = []
            for _ in range(reps):
                spec = (dict(engine="strata", model=model, backend=backend, kind=kind, n_prompt=n,
                             n_decode=a.decode, vram_gib=vram) if eng == "strata" else
                        dict(engine="llama", model=model, kind=kind, n_prompt=n, n_decode=a.decode,
                             threads=a.threads, gpu_layers=0 if a.config == "cpu" else -1))
                runs.append(run_child(spec, a.timeout))
            ok = [r for r in runs if "error" not in r]
            if not ok:
                res[eng] = {"error": runs[0]["error"]}
                continue
            key = "decode_ms" if kind == "decode" else "prefill_tok_s"
            res[eng] = {key: float(np.median([r[key] for r in ok])),
                        "peak_rss_gib": max(r["peak_rss_gib"] for r in ok)}
        rows.append((label, kind, res))
        s, ll = res["strata"], res["llama.cpp"]
        if "error" in s or "error" in ll:
            print(f"| {label} | strata {s} | llama.cpp {ll} |", flush=True)
            continue
        if kind == "decode":
            ts, tl = 1e3 / s["decode_ms"], 1e3 / ll["decode_ms"]
        else:
            ts, tl = s["prefill_tok_s"], ll["prefill_tok_s"]
        print(f"| {label} | {ts:.2f} tok/s | {tl:.2f} tok/s | {ts / tl:.3f} | {s['peak_rss_gib']:.2f} GiB | "
              f"{ll['peak_rss_gib']:.2f} GiB |", flush=True)


if __name__ == "__main__":
    main()
