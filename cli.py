"""Strata command line: thin argument parsing over the strata package."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help; an unset default (None, or False for a flag) is said in words."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Subcommand parsers are of the parent's class, so each gets the formatter."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=_Help, **kwargs)


def _progress(done: int, total: int, label: str = "prompt", scale: int = 1, unit: str = "") -> None:
    """Progress: a live line on a terminal, one line per update where stderr is a file or a pipe. With `scale`
    the counts are shown divided by it, to one decimal, then `unit` (bytes as MiB: scale 2**20, unit " MiB")."""
    shown = f"{done}/{total}" if scale == 1 else f"{done / scale:.1f}/{total / scale:.1f}{unit}"
    if sys.stderr.isatty():
        print(f"\r{label} {shown}", end="" if done < total else "\n", file=sys.stderr, flush=True)
    else:
        print(f"{label} {shown}", file=sys.stderr, flush=True)


def _preload_progress(done: int, total: int) -> None:
    _progress(done, total, "preloading experts", scale=1 << 30, unit=" GiB")


def _write_progress(label: str):
    """A GGUF writer's progress (tensor, bytes done, bytes total; per chunk) as _progress lines, one per percent."""
    shown = [-1]

    def report(name: str, done: int, total: int) -> None:
        percent = done * 100 // max(total, 1)
        if percent > shown[0]:
            shown[0] = percent
            _progress(done, total, label, scale=1 << 20, unit=" MiB")
    return report


def _number_or(word: str, kind, what: str, least: float | None = None):
    """An argparse type: `word` (None: the engine's default), or a `kind` number (at least `least`)."""
    def parse(v: str):
        if v == word:
            return None
        try:
            n = kind(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{v}': {what}, or {word}") from None
        if least is not None and n < least:
            raise argparse.ArgumentTypeError(f"'{v}': {what} must be {least:g} or more")
        return n
    return parse


def _at_least(least: int, what: str):
    """An argparse type: an integer of at least `least`."""
    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{v}': {what}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"'{v}': {what} must be {least} or more")
        return n
    return parse


_step_tokens = _number_or("auto", int, "a number of tokens", 1)        # --step-tokens
_promote = _number_or("all", int, "a number of experts", 0)            # --promote-per-layer
_ple_cache = _number_or("auto", float, "MiB", 0)                       # --ple-cache-mib


def _host(a):
    from strata.engine import HostConfig
    ctx = {} if a.ctx is None else {"max_ctx": a.ctx}       # the CUDA KV cache holds the context asked for
    host = None if a.host_budget_gib is None else int(a.host_budget_gib * (1 << 30))
    ple = None if a.ple_cache_mib is None else int(a.ple_cache_mib * (1 << 20))
    return HostConfig(vram_budget_bytes=int(a.vram_budget_gib * (1 << 30)), experts=a.experts,
                      step_tokens=a.step_tokens, host_budget_bytes=host, ple_cache_bytes=ple, prefetch=a.prefetch,
                      stream_experts=a.stream_experts, map_experts=a.map_experts, mapped_reads=a.mapped_reads,
                      prefetch_extra=a.prefetch_extra, promote_per_layer=a.promote_per_layer,
                      cache_half_life=a.cache_half_life, **ctx)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _sampling(a, **kw):
    from strata.sampling import SamplingParams
    return SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, seed=a.seed,
                          presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                          repetition_penalty=a.repetition_penalty, stop=tuple(a.stop or ()),
                          stop_at_eos=not a.ignore_eos, **kw)


def _tokens(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens wants comma-separated integers like 1,2,3, got {s!r}") from None


def cmd_generate(a) -> int:
    import uvloop

    from strata.engine import BackendUnavailable, Engine, EngineError
    params = _sampling(a, max_tokens=a.max_tokens)

    async def run() -> None:
        opened: list[str] = []          # the open line, shown once the request is admitted (a refused one's error
                                        # stays the first line)

        def progress(done: int, total: int) -> None:
            while opened:
                _log(opened.pop())
            _progress(done, total)
        async with await Engine.open(a.model, backend=a.backend, host=_host(a), trace=a.trace, n_ctx=a.ctx,
                                     log=opened.append) as eng:
            if a.preload:
                while opened:
                    _log(opened.pop())
                await eng.preload_experts(_preload_progress)
            async for c in eng.generate(a.prompt, params, progress=progress):
                sys.stdout.write(c.text)
                sys.stdout.flush()
        t = c.timings
        print(file=sys.stdout)
        print(f"prompt: {c.prompt_tokens} tokens, {t.prefill_tok_s:.1f} tok/s | generation: {c.index} tokens, "
              f"{t.decode_tok_s:.1f} tok/s ({c.finish_reason})", file=sys.stderr)

    try:
        uvloop.run(run())
    except BackendUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EngineError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_chat(a) -> int:
    """An interactive chat on stdin: each line is a user turn, answered under the model's chat template with the
    whole history; /clear forgets it, /exit or end of input ends."""
    from strata.chat import ChatFormat
    from strata.engine import BackendUnavailable, ContextLengthError, Engine, EngineError
    try:
        eng = Engine.open_sync(a.model, backend=a.backend, host=_host(a), trace=a.trace, n_ctx=a.ctx, log=_log)
    except BackendUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tty = sys.stdin.isatty()
    with eng:
        if a.preload:
            eng.preload_experts_sync(_preload_progress)
        fmt = ChatFormat.of(eng)
        start = [{"role": "system", "content": a.system}] if a.system else []
        history = list(start)
        kwargs = {"enable_thinking": False} if a.no_think else {}
        if tty:
            print(f"chat (context {eng.n_ctx} tokens): /clear forgets the conversation, /exit or Ctrl-D ends",
                  file=sys.stderr)
        while True:
            try:
                line = input("> " if tty else "")
            except EOFError:
                break
            if line.strip() == "/exit":
                break
            if line.strip() == "/clear":
                history = list(start)
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            ids = fmt.prompt_ids(history, **kwargs)
            params = _sampling(a, max_tokens=a.max_tokens or max(eng.n_ctx - len(ids), 1),
                               stop_token_ids=fmt.end_of_turn)
            reply = []
            try:
                for c in eng.generate_iter(ids, params):
                    sys.stdout.write(c.text)
                    sys.stdout.flush()
                    reply.append(c.text)
            except ContextLengthError as e:
                history.pop()
                print(f"error: {e}; /clear starts a new conversation", file=sys.stderr)
                continue
            except EngineError as e:
                print(f"\nerror: {e}", file=sys.stderr)
                return 1
            print()
            history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_serve(a) -> int:
    import asyncio
    import signal

    import uvloop

    from strata.engine import BackendUnavailable, Engine
    from strata.server import serve

    async def run() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):      # a clean stop: requests aborted, the engine closed
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        async with await Engine.open(a.model, backend=a.backend, host=_host(a), trace=a.trace, n_ctx=a.ctx) as eng:
            if a.preload:
                await eng.preload_experts(_preload_progress)
            name = a.name or Path(eng.model.file.path).stem

            def ready(host: str, port: int) -> None:       # the open line after: the address stays the first line
                _log(f"serving {name} (context {eng.n_ctx} tokens) at http://{host}:{port}/v1"
                     f"{' (API key required)' if a.api_key else ''}")
                _log(eng.open_line)
            await serve(eng, host=a.host, port=a.port, api_key=a.api_key, name=name, stop=stop, ready=ready)

    try:
        uvloop.run(run())
    except BackendUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_trace(a) -> int:
    from strata.host.trace import format_summary, load, summarize
    print(format_summary(summarize(load(a.file)), load(a.file, "prefix")))
    return 0


def cmd_logits(a) -> int:
    import numpy as np

    from strata.diagnose import first_nonfinite
    from strata.engine import Engine
    from strata.reference.model import StageDump
    with Engine.open_sync(a.model, exact=a.exact) as eng:
        dump = StageDump() if a.dump else None
        with np.errstate(all="ignore"):      # a non-finite logit is reported below, where it came from
            out = eng.logits(a.tokens, dump=dump).astype(np.float32)
        bad = np.flatnonzero(~np.isfinite(out).all(axis=1))
        if bad.size:
            where = first_nonfinite(eng.model, a.tokens, ref=eng.ref)
            cause = (f"the first non-finite value is at {where}: the weights are broken (`cli.py inspect "
                     f"{a.model} --check-weights` scans every tensor)" if where else
                     "a re-run of the reference found every value finite")
            raise FloatingPointError(f"the logits at position {bad[0]} are not finite (NaN or inf); {cause}")
    with open(a.out, "wb") as f:            # exactly these names: np.save(path) would append .npy, savez .npz
        np.save(f, out)
    if dump is not None:
        with open(a.dump, "wb") as f:
            dump.save(f)
    print(f"wrote {a.out}: float32 {list(out.shape)}", file=sys.stderr)
    return 0


def cmd_inspect(a) -> int:
    from strata.inspect import report
    from strata.model.loader import load_model
    from strata.model.validate import scan_finite
    m = load_model(a.model)
    print(report(m))
    if a.check_weights:
        scan_finite(m.file)
        print(f"weights   every value of the {len(m.file.tensors)} tensors is finite")
    return 0


def cmd_convert(a) -> int:
    from strata.model.convert import convert
    convert(a.hf_dir, a.out, a.outtype, mix=a.mix, threads=a.threads, progress=_write_progress("convert"))
    return 0


def cmd_quantize(a) -> int:
    from strata.model.quantize_file import quantize_gguf
    quantize_gguf(a.model, a.out, a.mix, threads=a.threads, progress=_write_progress("quantize"))
    return 0


def cmd_make_model(a) -> int:
    from strata.model.synth import make_model
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)     # models/ is not in a fresh clone
    make_model(a.preset, a.out, seed=a.seed, mix=a.mix, ple_base=a.ple_base, threads=a.threads, routing=a.routing)
    return 0


def _engine_options(g) -> None:
    g.add_argument("--model", "-m", help="GGUF file (default: the embedded tiny model)")
    g.add_argument("--ctx", type=int, default=None,
                   help="context length: a request's prompt + max tokens must fit (default: the model's "
                        "context_length; with --backend cuda at most 8192, as the device's KV cache is reserved "
                        "for --ctx positions)")
    g.add_argument("--backend", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    g.add_argument("--vram-budget-gib", type=float, default=24.0,
                   help="CUDA: device memory in use while the engine runs, its CUDA context and graphs included")
    g.add_argument("--experts", default="auto", choices=["auto", "vram", "host"],
                   help="CUDA: every expert in VRAM, or experts in host memory behind a VRAM cache; auto: vram "
                        "when the budget holds every weight")
    g.add_argument("--host-budget-gib", type=float, default=None,
                   help="the RAM tier: expert blobs kept in host memory (an LRU over what was read; the rest is read "
                        "from the file with O_DIRECT as needed); on the cpu backend a budget below the experts' size "
                        "selects that path (default: every expert, at most half the RAM)")
    g.add_argument("--prefetch", default="off", choices=["previous", "router", "off"],
                   help="read each layer's likely experts while the layer before runs: the ones it used in the "
                        "previous step, or its router's top k over the layer before's MoE input (the trace reports "
                        "how many misses it predicted)")
    g.add_argument("--stream-experts", default="auto", choices=["auto", "always", "never"],
                   help="experts in host memory, a step of several rows (a prompt chunk): copy every expert a layer "
                        "lacks in VRAM through a double buffer while the layer before computes, instead of splitting "
                        "the misses between the CPU pool and uploads; auto: by how many routes the chunk's rows give "
                        "each expert, then by each mode's measured time per row (the trace says which each step "
                        "used)")
    g.add_argument("--preload", action="store_true",
                   help="read every expert into the RAM tier before the first request (progress on stderr): no "
                        "expert read from disk while decoding, and with --experts host and a RAM tier that holds them "
                        "all, decode rows run as mapped tokens (see --map-experts)")
    g.add_argument("--map-experts", default="auto", choices=["auto", "always", "never"],
                   help="experts in host memory, a decode row, every expert held in RAM (--host-budget-gib large "
                        "enough; they are read as routed, or all first with --preload): run the token as one "
                        "graph whose kernels read the VRAM cache's experts in place and the misses from pinned host "
                        "memory over PCIe (misses are promoted into the cache while the next token runs), instead of "
                        "a host round trip per layer; auto: by each mode's measured time per token")
    g.add_argument("--mapped-reads", default="prefetch", choices=["fetch", "prefetch", "direct"],
                   help="mapped tokens: fetch, a kernel on every SM first copies each layer's misses from pinned "
                        "host memory into VRAM staging; prefetch, the same, and the next layer's router applied to "
                        "this layer's MoE input predicts its experts, whose misses are fetched beside this layer's "
                        "compute (the trace gives how many it predicted; the fastest: 8.6 against 10.9 ms of graph "
                        "a 24 GiB token on an H100); direct, the expert kernels read them over PCIe themselves "
                        "(fetch and direct measured near PCIe speed on the H200: bench/RESULTS.md)")
    g.add_argument("--prefetch-extra", type=_at_least(0, "a number of experts"), default=0, metavar="N",
                   help="--mapped-reads prefetch: the prediction keeps N experts beyond the model's top k (0 .. 16; "
                        "more of the misses predicted, for PCIe bytes read beside the compute; default 0)")
    g.add_argument("--promote-per-layer", type=_promote, default="all", metavar="N|all",
                   help="mapped tokens: a token's misses promoted into the VRAM cache while the next token runs, at "
                        "most N a layer (the copies share PCIe with that token's in-place reads); all: every one")
    g.add_argument("--cache-half-life", type=_at_least(1, "a number of tokens"), default=512, metavar="TOKENS",
                   help="the VRAM expert cache counts each expert's routes, a route TOKENS tokens old worth half a new "
                        "one; a mapped token's miss is promoted only over a less popular victim (default 512)")
    g.add_argument("--ple-cache-mib", type=_ple_cache, default="auto", metavar="MIB|auto",
                   help="PLE table rows kept in RAM: a hot-row cache of MIB (0: every row is read from the file), "
                        "the whole table (read at open) when MIB is at least its size; auto: the whole table when it "
                        "takes at most a quarter of the RAM, else 64")
    g.add_argument("--step-tokens", type=_step_tokens, default="auto", metavar="N|auto",
                   help="tokens per step at most: decode rows first, then prompt chunks (on CUDA also the "
                        "batched path's largest step); auto: 4096 on CUDA (halved down to 512 while the VRAM budget "
                        "cannot hold their activations; 8192 prefills prompts past ~8K tokens faster under a budget), "
                        "512 on the CPU")
    g.add_argument("--trace", metavar="FILE", help="write per-step latency traces here (JSON lines)")


def _sampling_options(g, max_tokens: int | None) -> None:
    g.add_argument("--max-tokens", "-n", type=int, default=max_tokens,
                   help="tokens to generate at most" + ("" if max_tokens else " (default: the rest of the context)"))
    g.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set this likely; 1 = off")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this times the most likely one; 0 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of each token generated so far, in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted once per time a token was generated so far, in [-2, 2]")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="tokens of the prompt and output: positive logits divided by it, negative multiplied; "
                        "1 = off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one)")
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop before this text (repeat for more; default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past EOS (and end-of-turn tokens)")


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="cli.py", description="Strata: Qwen3.8-Flash-Next (qwen4exp) inference")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("prompt", nargs="?", default="Once upon a time", help="the prompt text")
    _sampling_options(g, 64)
    _engine_options(g)
    g.set_defaults(fn=cmd_generate)

    ch = sub.add_parser("chat", help="an interactive chat on stdin, under the model's chat template")
    ch.add_argument("--system", help="a system message to start the conversation with (default: none)")
    ch.add_argument("--no-think", action="store_true",
                    help="pass enable_thinking=false to the template (Qwen3: no <think> reasoning)")
    _sampling_options(ch, None)
    _engine_options(ch)
    ch.set_defaults(fn=cmd_chat)

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, "
                                      "/v1/models, /health")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    sv.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    sv.add_argument("--api-key", default=os.environ.get("STRATA_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1/ (default: $STRATA_API_KEY; unset: no key)")
    sv.add_argument("--name", help="the model's id in the API (default: the GGUF file name without .gguf)")
    _engine_options(sv)
    sv.set_defaults(fn=cmd_serve)

    tr = sub.add_parser("trace", help="summarize a --trace file: where each step's time went")
    tr.add_argument("file")
    tr.set_defaults(fn=cmd_trace)

    lg = sub.add_parser("logits", help="teacher-forced logits of a token sequence to a .npy file")
    lg.add_argument("model")
    lg.add_argument("--tokens", type=_tokens, required=True, help="comma-separated token ids")
    lg.add_argument("--out", required=True, help="output file (.npy format, written under exactly this name): "
                                                 "float32 [n_tokens, n_vocab]")
    lg.add_argument("--dump", help="also write the per-layer, per-stage values (C1 oracle) to this .npz")
    lg.add_argument("--exact", action="store_true", help="f32 activations in quantized matvecs")
    lg.set_defaults(fn=cmd_logits)

    i = sub.add_parser("inspect", help="metadata, tensor types and bytes, bytes per token")
    i.add_argument("model")
    i.add_argument("--check-weights", action="store_true",
                   help="also read every tensor and fail naming the first that holds NaN or inf")
    i.set_defaults(fn=cmd_inspect)

    c = sub.add_parser("convert", help="transformers Qwen4-Exp checkpoint folder -> GGUF, streamed tensor by "
                                       "tensor in bounded memory")
    c.add_argument("hf_dir", help="the folder: config.json, *.safetensors, and tokenizer.json (byte-level BPE; "
                                  "without it a small synthetic vocabulary is written), tokenizer_config.json, "
                                  "chat_template.jinja when present")
    c.add_argument("out", help="the GGUF file to write")
    types = c.add_mutually_exclusive_group()
    types.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"],
                       help="the type of every matrix (vectors stay F32)")
    types.add_argument("--mix", help="instead of --outtype, per-tensor types as make-model --mix writes them: f32, "
                                     "bf16, q8_0 or realistic (default: none)")
    c.add_argument("--threads", type=int, default=None, help="quantizer threads (default: one per core)")
    c.set_defaults(fn=cmd_convert)

    qz = sub.add_parser("quantize", help="rewrite a GGUF's tensors in a mix's types, streamed; metadata copied "
                                         "unchanged")
    qz.add_argument("model", help="the GGUF file to read")
    qz.add_argument("out", help="the GGUF file to write")
    qz.add_argument("--mix", default="realistic",
                    help="f32, bf16, q8_0 or realistic: each tensor gets the type make-model --mix gives it")
    qz.add_argument("--threads", type=int, default=None, help="quantizer threads (default: one per core)")
    qz.set_defaults(fn=cmd_quantize)

    mm = sub.add_parser("make-model", help="random weights straight to GGUF, deterministic by seed")
    mm.add_argument("out")
    mm.add_argument("--preset", default="tiny", help="tiny, small, medium, flash (the real geometry) or flash-host "
                    "(flash's layers, experts and vocabulary at small widths: host work without a GPU)")
    mm.add_argument("--seed", type=int, default=0, help="the weights' seed")
    mm.add_argument("--mix", default=None, help="f32, bf16, q8_0 or realistic (default: f32 for tiny, else realistic)")
    mm.add_argument("--ple-base", type=int, default=None,
                    help="rows per PLE head (default: the preset's; flash uses 20,000,000 like the real model)")
    mm.add_argument("--threads", type=int, default=None, help="writer threads (default: one per core)")
    mm.add_argument("--routing", default="uniform", choices=["uniform", "realistic"],
                    help="uniform: random routers, tokens spread almost evenly over the experts (a cache's worst "
                         "case); realistic: skewed router rows, calibrated per preset so that an LRU cache holding "
                         "45%% of each layer's experts hits about 80%% on text, as published for the trained model "
                         "(recorded in the strata.routing.* metadata)")
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
