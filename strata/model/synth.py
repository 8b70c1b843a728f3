"""`cli.py make-model --preset NAME OUT.gguf`: random weights straight to GGUF, no torch, deterministic by seed.

Every chunk of every tensor draws from its own generator, seeded by (seed, tensor name, chunk index), so the
bytes do not depend on chunking or on the order threads finish in, and memory stays at a few chunks even for
the `flash` preset (the real geometry: 125B parameters, ~37 GB of experts and up to 28.8 GB of PLE table).
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
        rope_sections=(11, 11, 10, 0), **kw)


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
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class Plan:
    name: str
    shape: tuple[int, ...]     # ggml
    qtype: QType
    spec: Spec


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


def _rng(seed: int, name: str, chunk: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), chunk])


def tensor_chunks(p: Plan, seed: int, pool: ThreadPoolExecutor | None) -> Callable[[], Iterator[np.ndarray]]:
    """A source for the writer: the tensor's bytes in row chunks, generated ahead on `pool`."""
    n_in = p.shape[0]
    n_rows = int(np.prod(p.shape[1:], dtype=np.int64)) if len(p.shape) > 1 else 1
    rb = row_bytes(p.qtype, n_in)
    rows_per = max(1, min(n_rows, CHUNK_BYTES // max(rb, 1)))
    if len(p.shape) == 3:                       # whole experts per chunk, so one expert's bytes are one draw
        per_exp = p.shape[1]
        rows_per = max(per_exp, rows_per // per_exp * per_exp)
    starts = list(range(0, n_rows, rows_per))

    def make(i: int) -> np.ndarray:
        rows = min(rows_per, n_rows - starts[i])
        rng = _rng(seed, p.name, i)
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


def make_model(preset: str, out: str | os.PathLike, *, seed: int = 0, mix: str | None = None,
               ple_base: int | None = None, threads: int | None = None,
               log: Callable[[str], None] = print) -> ModelConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset '{preset}': choose one of {', '.join(PRESETS)}")
    mix = mix or ("f32" if preset == "tiny" else "realistic")
    if mix not in MIXES:
        raise ValueError(f"unknown mix '{mix}': choose one of {', '.join(MIXES)}")
    kw = dict(PRESETS[preset])
    note = f"strata make-model preset={preset} seed={seed} mix={mix}"
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
    workers = threads or os.cpu_count() or 1
    with ThreadPoolExecutor(workers) as pool:
        for p in plans:
            w.add_tensor(p.name, p.shape, p.qtype, tensor_chunks(p, seed, pool if workers > 1 else None))
        t0, last = time.time(), [0.0]

        def progress(name: str, done: int, total: int) -> None:
            now = time.time()
            if now - last[0] > 5 or done == total:
                last[0] = now
                rate = done / max(now - t0, 1e-9) / 2**20
                log(f"  {done / 2**30:7.2f} / {total / 2**30:.2f} GiB  {rate:7.0f} MiB/s  {name}")
        size = w.write(progress)
    log(f"wrote {out}: preset {preset}, {size / 2**30:.2f} GiB, mix {mix}, seed {seed}")
    return replace(cfg, notes=(note,))
