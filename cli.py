"""Strata command line: thin argument parsing over the strata package."""

from __future__ import annotations

import argparse
import sys


def _tokens(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens wants comma-separated integers like 1,2,3, got {s!r}") from None


def cmd_generate(a) -> int:
    import uvloop

    from strata.engine import Engine, EngineError, HostConfig
    from strata.sampling import SamplingParams
    params = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
                            max_tokens=a.max_tokens, stop_at_eos=not a.ignore_eos)

    def progress(done: int, total: int) -> None:
        print(f"\rprompt {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)

    async def run() -> None:
        host = HostConfig(vram_budget_bytes=int(a.vram_budget_gib * (1 << 30)), experts=a.experts,
                          step_tokens=a.step_tokens)
        async with await Engine.open(a.model, backend=a.backend, host=host, trace=a.trace) as eng:
            async for c in eng.generate(a.prompt, params, progress=progress):
                sys.stdout.write(c.text)
                sys.stdout.flush()
        t = c.timings
        print(file=sys.stdout)
        print(f"prompt: {c.prompt_tokens} tokens, {t.prefill_tok_s:.1f} tok/s | generation: {c.index} tokens, "
              f"{t.decode_tok_s:.1f} tok/s ({c.finish_reason})", file=sys.stderr)

    try:
        uvloop.run(run())
    except EngineError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_trace(a) -> int:
    from strata.host.trace import format_summary, load, summarize
    print(format_summary(summarize(load(a.file))))
    return 0


def cmd_logits(a) -> int:
    import numpy as np
    from strata.engine import Engine
    from strata.reference.model import StageDump
    eng = Engine.open_sync(a.model, exact=a.exact)
    dump = StageDump() if a.dump else None
    out = eng.logits(a.tokens, dump=dump)
    np.save(a.out, out.astype(np.float32))
    if dump is not None:
        dump.save(a.dump)
    print(f"wrote {a.out}: float32 {list(out.shape)}", file=sys.stderr)
    return 0


def cmd_inspect(a) -> int:
    from strata.inspect import report
    from strata.model.loader import load_model
    print(report(load_model(a.model)))
    return 0


def cmd_convert(a) -> int:
    from strata.model.convert import convert
    convert(a.hf_dir, a.out, a.outtype)
    return 0


def cmd_make_model(a) -> int:
    from strata.model.synth import make_model
    make_model(a.preset, a.out, seed=a.seed, mix=a.mix, ple_base=a.ple_base, threads=a.threads)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cli.py", description="Strata: Qwen3.8-Flash-Next (qwen4exp) inference")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("prompt", nargs="?", default="Once upon a time")
    g.add_argument("--model", "-m", help="GGUF file (default: the embedded tiny model)")
    g.add_argument("--max-tokens", "-n", type=int, default=64)
    g.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    g.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    g.add_argument("--vram-budget-gib", type=float, default=24.0,
                   help="CUDA: device memory in use while the engine runs, its CUDA context and graphs included "
                        "(default 24)")
    g.add_argument("--experts", default="auto", choices=["auto", "vram", "host"],
                   help="CUDA: every expert in VRAM, or experts in host memory behind a VRAM cache; auto: vram "
                        "when the budget holds every weight (default)")
    g.add_argument("--step-tokens", type=int, default=512,
                   help="tokens per step at most: decode rows first, then prompt chunks (default 512; the CUDA "
                        "backend takes 1)")
    g.add_argument("--trace", metavar="FILE", help="write per-step latency traces here (JSON lines)")
    g.set_defaults(fn=cmd_generate)

    tr = sub.add_parser("trace", help="summarize a --trace file: where each step's time went")
    tr.add_argument("file")
    tr.set_defaults(fn=cmd_trace)

    lg = sub.add_parser("logits", help="teacher-forced logits of a token sequence to a .npy file")
    lg.add_argument("model")
    lg.add_argument("--tokens", type=_tokens, required=True, help="comma-separated token ids")
    lg.add_argument("--out", required=True, help="output .npy: float32 [n_tokens, n_vocab]")
    lg.add_argument("--dump", help="also write the per-layer, per-stage values (C1 oracle) to this .npz")
    lg.add_argument("--exact", action="store_true", help="f32 activations in quantized matvecs")
    lg.set_defaults(fn=cmd_logits)

    i = sub.add_parser("inspect", help="metadata, tensor types and bytes, bytes per token")
    i.add_argument("model")
    i.set_defaults(fn=cmd_inspect)

    c = sub.add_parser("convert", help="transformers Qwen4-Exp checkpoint folder -> GGUF")
    c.add_argument("hf_dir")
    c.add_argument("out")
    c.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"])
    c.set_defaults(fn=cmd_convert)

    mm = sub.add_parser("make-model", help="random weights straight to GGUF, deterministic by seed")
    mm.add_argument("out")
    mm.add_argument("--preset", default="tiny", help="tiny, small, medium or flash (the real geometry)")
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--mix", default=None, help="f32, bf16, q8_0 or realistic (default: f32 for tiny, else realistic)")
    mm.add_argument("--ple-base", type=int, default=None,
                    help="rows per PLE head (default: the preset's; flash uses 20,000,000 like the real model)")
    mm.add_argument("--threads", type=int, default=None)
    mm.set_defaults(fn=cmd_make_model)

    a = p.parse_args(argv)
    try:
        return a.fn(a)
    except (ValueError, OSError, FloatingPointError) as e:
        # bad input (a broken file, a wrong value): one line that says what to fix, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
