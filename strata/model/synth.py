"""`cli.py make-model --preset NAME OUT.gguf`: random weights straight to GGUF, no torch, deterministic by seed.

Every chunk of every tensor draws from its own generator, seeded by (seed, tensor name, chunk index), so the
bytes do not depend on chunking or on the order threads finish in, and memory stays at a few chunks even for
the `flash` preset (the real geometry: 125B parameters, ~37 GB of experts and up to 28.8 GB of PLE table).

Routing (`--routing`): random routers spread tokens almost evenly over the experts, the worst case for an expert
cache. `realistic` scales each router row by its own log-normal factor, calibrated per preset so that an LRU cache
per layer holding 45% of the experts hits 80% over a decode of English text (bench/calibrate_routing.py measures it).
Only ffn_gate_inp's values change; no tensor is added and the forward is the same function.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
from gguf import GGUFValueType as VT

from strata.config import ModelConfig
from strata.model import ple_hash
from strata.model.convert import write_metadata
from strata.model.gguf_writer import GGUFStreamWriter
from strata.model.schema import Spec, all_specs
from strata.quant import QType, block_size, quantize, random_blocks, row_bytes
from strata.tokenizer import build_vocab


# Qwen3.8-Flash-Next's MRoPE sections, in rotary pairs: 11 + 11 + 10 = 32 = its n_rot (64) / 2
FLASH_ROPE_SECTIONS = (11, 11, 10)


def rope_sections(n_rot: int) -> tuple[int, int, int, int]:
    """The real model's sections scaled to n_rot / 2 rotary pairs (largest remainder, ties to the first), so every
    pair has a section: llama.cpp's interleaved MRoPE asserts they fit the rotated heads (the indexer's included)."""
    pairs, total = n_rot // 2, sum(FLASH_ROPE_SECTIONS)
    exact = [pairs * s / total for s in FLASH_ROPE_SECTIONS]
    out = [int(x) for x in exact]
    for i in sorted(range(3), key=lambda i: out[i] - exact[i])[:pairs - sum(out)]:
        out[i] += 1
    return (*out, 0)


def _geometry(**kw) -> ModelConfig:
    """A ModelConfig from the HF-style knobs a preset sets; layer i is QSA when (i + 1) % 4 == 0."""
    n_layer = kw["n_layer"]
    recurrent = tuple((i + 1) % 4 != 0 for i in range(n_layer))
    ratio = kw.pop("ratio", 4)
    ple_layer = kw.pop("ple_layer", 1)
    heads_per_ngram = kw.pop("heads_per_ngram", 8)
    ple_base = kw.pop("ple_base", 20_000_000)
    n_heads = 2 * heads_per_ngram
    sizes = ple_hash.head_vocab_sizes(ple_base, n_heads)
    return ModelConfig(
        recurrent=recurrent, compress_ratios=tuple(0 if r else ratio for r in recurrent),
        ple_layers=(ple_layer,), ple_ngram=3, ple_heads_per_ngram=heads_per_ngram, ple_conv=4,
        ple_eos=kw["eos_id"], ple_row=kw["n_embd"] // n_heads,
        ple_multipliers=tuple(ple_hash.layer_multipliers(kw["n_vocab"], 3, 0, 1234)),
        ple_offsets=tuple(ple_hash.head_offsets(sizes)), ple_vocab_sizes=tuple(sizes),
        rope_sections=rope_sections(kw["n_rot"]), **kw)


PRESETS: dict[str, dict] = {
    # the CI model and the default of `generate`: seconds to make, every code path present
    "tiny": dict(n_layer=4, n_embd=64, n_vocab=512, n_ctx_train=4096, rms_eps=1e-6, n_head=4, n_head_kv=2,
                 head_dim=32, n_rot=8, rope_base=1e7, idx_heads=4, idx_dim=16, idx_budget=16, ssm_conv=4,
                 ssm_state=16, ssm_k_heads=2, ssm_v_heads=6, hc=4, hc_rank=16, n_expert=16, n_expert_used=4,
                 n_ff_exp=32, n_ff_shexp=32, eos_id=500, heads_per_ngram=2, ple_base=1009),
    # K-quant friendly rows (multiples of 256) for the realistic type mix on this machine's CPU
    "small": dict(n_layer=8, n_embd=256, n_vocab=4096, n_ctx_train=32768, rms_eps=1e-6, n_head=8, n_head_kv=2,
                  head_dim=64, n_rot=16, rope_base=1e7, idx_heads=4, idx_dim=32, idx_budget=64, ssm_conv=4,
                  ssm_state=32, ssm_k_heads=4, ssm_v_heads=12, hc=4, hc_rank=64, n_expert=64, n_expert_used=8,
                  n_ff_exp=256, n_ff_shexp=256, eos_id=4000, heads_per_ngram=4, ple_base=20011),
    # a few GB: the CPU-only benchmark configuration
    "medium": dict(n_layer=16, n_embd=1024, n_vocab=32768, n_ctx_train=32768, rms_eps=1e-6, n_head=8, n_head_kv=2,
                   head_dim=128, n_rot=32, rope_base=1e7, idx_heads=4, idx_dim=128, idx_budget=2048, ssm_conv=4,
                   ssm_state=128, ssm_k_heads=8, ssm_v_heads=24, hc=4, hc_rank=128, n_expert=128, n_expert_used=8,
                   n_ff_exp=512, n_ff_shexp=512, eos_id=32000, heads_per_ngram=8, ple_base=200_003),
    # Qwen3.8-Flash-Next's geometry (MODEL.md)
    "flash": dict(n_layer=48, n_embd=2560, n_vocab=248320, n_ctx_train=262144, rms_eps=1e-6, n_head=24,
                  n_head_kv=2, head_dim=256, n_rot=64, rope_base=1e7, idx_heads=4, idx_dim=128, idx_budget=2048,
                  ssm_conv=4, ssm_state=128, ssm_k_heads=16, ssm_v_heads=48, hc=4, hc_rank=320, n_expert=512,
                  n_expert_used=10, n_ff_exp=640, n_ff_shexp=640, eos_id=248044, heads_per_ngram=8,
                  ple_base=20_000_000),
    # flash's host-side shape (48 layers, 512 experts top-10, a 248,320-token vocabulary, the PLE heads) at the
    # small preset's widths: the host's tables, copies and bookkeeping per token and per layer as on flash (1.5 GB
    # in the realistic mix), for host-side benchmarks on a machine without a GPU
    "flash-host": dict(n_layer=48, n_embd=256, n_vocab=248320, n_ctx_train=32768, rms_eps=1e-6, n_head=8,
                       n_head_kv=2, head_dim=64, n_rot=16, rope_base=1e7, idx_heads=4, idx_dim=32, idx_budget=64,
                       ssm_conv=4, ssm_state=32, ssm_k_heads=4, ssm_v_heads=12, hc=4, hc_rank=64, n_expert=512,
                       n_expert_used=10, n_ff_exp=256, n_ff_shexp=256, eos_id=248044, heads_per_ngram=8,
                       ple_base=20011),
}

# The realistic mix (issue 3): experts Q2_0, dense K-quants and IQ4_XS, router/alpha/beta BF16, PLE table IQ4_NL.
REALISTIC = [
    ("ffn_gate_exps", QType.Q2_0), ("ffn_up_exps", QType.Q2_0), ("ffn_down_exps", QType.Q2_0),
    ("ffn_gate_inp.", QType.BF16), ("ssm_alpha", QType.BF16), ("ssm_beta", QType.BF16),
    ("per_layer_token_embd", QType.IQ4_NL), ("token_embd", QType.Q6_K), ("output.", QType.Q6_K),
    ("attn_qkv", QType.IQ4_XS), ("attn_gate", QType.IQ4_XS), ("ssm_out", QType.Q4_K),
    ("attn_q.", QType.Q4_K), ("attn_k.", QType.Q4_K), ("attn_v.", QType.Q6_K), ("attn_output", QType.Q4_K),
    ("shexp", QType.Q5_K), ("indexer", QType.Q8_0), ("ple_key", QType.Q8_0), ("ple_value", QType.Q8_0),
    ("hc_", QType.Q8_0), ("output_hc", QType.Q8_0),
]
MIXES = ("f32", "bf16", "q8_0", "realistic")
ROUTINGS = ("uniform", "realistic")
# Realistic routing: expert e's router row is scaled by exp(skew * z_e), z_e ~ N(0, 1) per layer, rescaled to RMS 1,
# so experts with wide logits reach the top-k far more often: popular experts without a bias tensor. Top-k selection
# depends only on the direction of the router's input, so a skew (the log-std of the experts' router-logit standard
# deviations) selects alike at any width or depth while that input is near isotropic, as it is under random weights;
# the expert count and k still matter (top 10 of 512 is a far sharper cut than top 8 of 64), hence one value per
# preset. Under sign-symmetric inputs an expert is in the top-k of at most about half the tokens, which caps the tiny
# preset (16 experts top-4) near 65%: it has no realistic routing. Measured by
# `python bench/calibrate_routing.py calibrate --preset P` (bench/RESULTS.md).
ROUTING_SKEW = {"small": 0.8906, "medium": 0.4102, "flash": 0.2286, "flash-host": 0.2286}
# What each default skew measured: the mean over layers of an LRU per layer holding LRU_CAPACITY of the experts
ROUTING_HIT = {"small": 0.7965, "medium": 0.7992, "flash": 0.8007, "flash-host": 0.8007}
ROUTING_CALIBRATION = {
    "small": "end to end: the CPU reference on 512 tokens of English text, seed 0",
    "medium": "end to end: the CPU reference on 512 tokens of English text, seed 0",
    "flash": "replay: the router inputs of flash's width and depth (20 experts, a 4096 vocabulary, a small PLE "
             "table; 512 tokens of English text) through 512-expert top-10 routers, mean of 4 router draws; flash "
             "itself is too large to run on the calibration machine",
    "flash-host": "flash's skew (the same 512-expert top-10 cut; a skew selects alike at any width), not "
                  "measured on this preset",
}
LRU_CAPACITY = 0.45
LRU_TARGET = 0.80
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class Plan:
    name: str
    shape: tuple[int, ...]     # ggml
    qtype: QType
    spec: Spec


def preset_config(preset: str) -> ModelConfig:
    """The ModelConfig of a preset's geometry (the benches' kernel shapes, without making a file)."""
    return _geometry(**PRESETS[preset])


def pick_type(name: str, n_in: int, mix: str) -> QType:
    """The type a matrix gets under `mix`, falling back to a block that divides its rows (then F32)."""
    want = {"f32": QType.F32, "bf16": QType.BF16, "q8_0": QType.Q8_0}.get(mix)
    if want is None:
        want = next((t for key, t in REALISTIC if key in name), QType.Q8_0)
    for qt in (want, QType.Q8_0, QType.BF16):
        if n_in % block_size(qt) == 0:
            return qt
    return QType.F32


def plan(cfg: ModelConfig, mix: str) -> list[Plan]:
    out = []
    for s in all_specs(cfg):
        if not s.required:      # the optional fused expert pair and `output` (added below, untied)
            continue
        shape = s.shapes[0]
        qt = QType.F32 if s.vector else pick_type(s.name, shape[0], mix)
        out.append(Plan(s.name, shape, qt, s))
    out.insert(1, Plan("output.weight", (cfg.n_embd, cfg.n_vocab), pick_type("output.", cfg.n_embd, mix),
                       Spec("output.weight", ((cfg.n_embd, cfg.n_vocab),))))
    return out


def _init(name: str, shape_np: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Float values for a (chunk of a) tensor, at scales that keep activations O(1)."""
    if name.endswith("ssm_a"):
        return -rng.uniform(0.01, 4.0, shape_np).astype(np.float32)             # -exp(A_log)
    if name.endswith("ssm_dt.bias"):
        return rng.normal(0, 0.5, shape_np).astype(np.float32)
    if name.endswith("conv1d.weight"):
        return rng.normal(0, 0.5, shape_np).astype(np.float32)
    if name.endswith("ssm_norm.weight") or "norm" in name:
        return (1 + rng.normal(0, 0.1, shape_np)).astype(np.float32)             # gammas around 1
    if name.startswith("per_layer_token_embd"):
        return rng.normal(0, 1, shape_np).astype(np.float32)
    return (rng.normal(0, 1, shape_np) / np.sqrt(shape_np[-1])).astype(np.float32)


def _scale(name: str, n_in: int) -> float:
    return 1.0 if name.startswith("per_layer_token_embd") else 1 / np.sqrt(n_in)


def _is_router(name: str) -> bool:
    return name.endswith("ffn_gate_inp.weight")


def _rng(seed: int, name: str, chunk: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), chunk])


def router_scales(seed: int, name: str, n_expert: int, skew: float) -> np.ndarray:
    """(n_expert,) per-expert router row scales exp(skew * z), z ~ N(0, 1), at RMS 1 (the logits' overall scale, and
    so the softmax's temperature, stays a random router's). Drawn whole for the layer, so chunking does not matter."""
    z = np.random.default_rng([seed, zlib.crc32(f"{name}#routing".encode())]).standard_normal(n_expert)
    s = np.exp(skew * z)
    return (s / np.sqrt(np.mean(s * s))).astype(np.float32)


def tensor_chunks(p: Plan, seed: int, pool: ThreadPoolExecutor | None,
                  skew: float | None = None) -> Callable[[], Iterator[np.ndarray]]:
    """A source for the writer: the tensor's bytes in row chunks, generated ahead on `pool`. `skew`: realistic
    routing's router row scales (router_scales) when p is a router."""
    n_in = p.shape[0]
    n_rows = int(np.prod(p.shape[1:], dtype=np.int64)) if len(p.shape) > 1 else 1
    rb = row_bytes(p.qtype, n_in)
    rows_per = max(1, min(n_rows, CHUNK_BYTES // max(rb, 1)))
    if len(p.shape) == 3:                       # whole experts per chunk, so one expert's bytes are one draw
        per_exp = p.shape[1]
        rows_per = max(per_exp, rows_per // per_exp * per_exp)
    starts = list(range(0, n_rows, rows_per))
    scales = router_scales(seed, p.name, n_rows, skew) if skew is not None and _is_router(p.name) else None

    def make(i: int) -> np.ndarray:
        rows = min(rows_per, n_rows - starts[i])
        rng = _rng(seed, p.name, i)
        if scales is not None:              # a float router's values, row e times scales[e]
            vals = _init(p.name, (rows, n_in), rng) * scales[starts[i]:starts[i] + rows, None]
            return quantize(vals, p.qtype)
        # random valid blocks for quantized types: quantizing random floats would cost minutes on the 125B preset
        if p.qtype in (QType.F32, QType.F16, QType.BF16) or p.spec.vector:
            vals = _init(p.name, (rows, n_in) if len(p.shape) > 1 else (n_in,), rng)
            return quantize(vals.reshape(-1, n_in) if len(p.shape) > 1 else vals[None, :], p.qtype)
        return random_blocks(p.qtype, (rows, n_in), rng, _scale(p.name, n_in))

    def gen() -> Iterator[np.ndarray]:
        if pool is None:
            for i in range(len(starts)):
                yield make(i)
            return
        ahead = 2 * (pool._max_workers or 1)
        futs = [pool.submit(make, i) for i in range(min(ahead, len(starts)))]
        for i in range(len(starts)):
            chunk = futs[i].result()
            futs[i] = None
            if i + ahead < len(starts):
                futs.append(pool.submit(make, i + ahead))
            yield chunk
    return gen


def routing_metadata(preset: str, routing: str, skew: float | None, calibrated: bool) -> list[tuple[str, VT, object]]:
    """The strata.routing.* keys: the option, its skew, and the LRU hit rate calibration measured (`calibrated`: the
    preset's own geometry at its calibrated skew; any other was not measured)."""
    out: list[tuple[str, VT, object]] = [("strata.routing", VT.STRING, routing)]
    if routing == "realistic":
        out.append(("strata.routing.skew", VT.FLOAT32, skew))
        if calibrated:
            out += [("strata.routing.lru_capacity", VT.FLOAT32, LRU_CAPACITY),
                    ("strata.routing.lru_hit_rate", VT.FLOAT32, ROUTING_HIT[preset]),
                    ("strata.routing.calibration", VT.STRING, ROUTING_CALIBRATION[preset])]
    return out


def make_model(preset: str, out: str | os.PathLike, *, seed: int = 0, mix: str | None = None,
               ple_base: int | None = None, threads: int | None = None, routing: str = "uniform",
               routing_skew: float | None = None, overrides: dict | None = None,
               log: Callable[[str], None] = print) -> ModelConfig:
    """`routing_skew`: realistic routing's skew (default: the preset's calibrated ROUTING_SKEW). `overrides`: preset
    knobs replaced (bench/calibrate_routing.py's proxies: a preset's width and depth with fewer experts)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset '{preset}': choose one of {', '.join(PRESETS)}")
    mix = mix or ("f32" if preset == "tiny" else "realistic")
    if mix not in MIXES:
        raise ValueError(f"unknown mix '{mix}': choose one of {', '.join(MIXES)}")
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing '{routing}': choose one of {', '.join(ROUTINGS)}")
    if routing == "uniform" and routing_skew is not None:
        raise ValueError("a routing skew is for --routing realistic")
    skew = None
    if routing == "realistic":
        if routing_skew is None and preset not in ROUTING_SKEW:
            cfg = PRESETS[preset]
            raise ValueError(f"preset {preset} has no realistic routing: with {cfg['n_expert']} experts top-"
                             f"{cfg['n_expert_used']}, skewed routers reach about 65% at {LRU_CAPACITY:.0%}, not "
                             f"{LRU_TARGET:.0%}; use --preset small or larger")
        skew = ROUTING_SKEW[preset] if routing_skew is None else float(routing_skew)
        if not 0 <= skew <= 8:
            raise ValueError(f"routing skew {skew} must be in [0, 8]")
    kw = dict(PRESETS[preset])
    note = f"strata make-model preset={preset} seed={seed} mix={mix} routing={routing}"
    if skew is not None:
        note += f" skew={skew:g}"
    if overrides:
        unknown = set(overrides) - set(kw)
        if unknown:
            raise ValueError(f"unknown preset knobs {sorted(unknown)}")
        kw.update(overrides)
        note += f" overrides={overrides}"
    if ple_base is not None:
        if ple_base < 2 * kw["heads_per_ngram"]:
            raise ValueError(f"--ple-base {ple_base} is too small")
        note += (f"; PLE table reduced to ~{ple_base} rows per head (the real model has ~20M per head) to fit the "
                 f"disk; per-token work is unchanged")
        kw["ple_base"] = ple_base
    cfg = _geometry(**kw)
    plans = plan(cfg, mix)
    tok = build_vocab(cfg.n_vocab, cfg.eos_id, seed=seed)

    w = GGUFStreamWriter(out)
    write_metadata(w, cfg, tok, f"strata-synthetic-{preset}")
    w.add("strata.synthetic", VT.STRING, note)
    calibrated = not overrides and skew is not None and skew == ROUTING_SKEW.get(preset)
    for key, vt, value in routing_metadata(preset, routing, skew, calibrated):
        w.add(key, vt, value)
    workers = threads or os.cpu_count() or 1
    with ThreadPoolExecutor(workers) as pool:
        for p in plans:
            w.add_tensor(p.name, p.shape, p.qtype, tensor_chunks(p, seed, pool if workers > 1 else None, skew))
        t0, last = time.time(), [0.0]

        def progress(name: str, done: int, total: int) -> None:
            now = time.time()
            if now - last[0] > 5 or done == total:
                last[0] = now
                rate = done / max(now - t0, 1e-9) / 2**20
                log(f"  {done / 2**30:7.2f} / {total / 2**30:.2f} GiB  {rate:7.0f} MiB/s  {name}")
        size = w.write(progress)
    log(f"wrote {out}: preset {preset}, {size / 2**30:.2f} GiB, mix {mix}, seed {seed}, routing {routing}"
        + (f" (skew {skew:g})" if skew is not None else ""))
    return replace(cfg, notes=(note,))
