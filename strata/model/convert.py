"""`cli.py convert HF_DIR OUT.gguf`: a transformers Qwen4-Exp checkpoint -> the llama.cpp qwen4exp schema.

What it does to the weights is what llama.cpp's converter does (conversion/qwen4exp.py, qwen.py), so files
from either converter hold the same numbers:
- zero-centred RMSNorm gammas are stored as (1 + w) (hc, attention q/k, indexer q/k, PLE norms; not the GDN
  gated norm);
- ssm_a = -exp(A_log); dt_bias -> ssm_dt.bias; conv weights squeezed to (channels, K);
- the indexer's fused index_qk_proj is split into q_proj and k_proj;
- GDN value heads are reordered from grouped-by-key-head to tiled (value head h uses key head h % Hk).

Streaming, with bounded memory: every transform above maps rows to rows (a selection or permutation of a source
tensor's rows, a permutation within each row, an elementwise function), so each GGUF tensor is a `Planned`
list of source row ranges, and its data is made CHUNK_ELEMENTS values at a time: rows read from the mapped
safetensors (and their pages given back), transformed in float32, quantized, written, dropped. The header needs
every tensor's type and shape first; they come from the safetensors headers and the schema, before any data is
read.

Memory bound: 1.5x the largest tensor's bf16 source size plus a fixed overhead, stated in bf16 (the size the
checkpoint holds) rather than the f32 working size because no tensor is ever whole in f32, nor whole at all:
the working set is a few chunks per worker thread (a chunk's f32 rows and the quantizer's temporaries, ~10x
4 MiB) on top of the fixed overhead (Python, numpy, numba, the vocabulary), so the peak does not grow with the
tensors. bench/bench_convert.py measures it: 183-289 MiB converting 3.3 GiB whose largest tensor is 768 MiB.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.config import ARCH, ModelConfig
from strata.model import ple_hash
from strata.model.gguf_writer import GGUFStreamWriter
from strata.model.safetensors_file import Checkpoint, CheckpointError
from strata.model.schema import all_specs
from strata.quant import QType, block_size, quantize
from strata.tokenizer import TokenizerError, build_vocab, from_hf_tokenizer_json

OUT_TYPES = {"f32": QType.F32, "f16": QType.F16, "bf16": QType.BF16, "q8_0": QType.Q8_0}
# float32 values per chunk (4 MiB): the unit of work of the streaming writers (convert and quantize); the
# quantizers' temporaries are ~10x a chunk, per worker thread
CHUNK_ELEMENTS = 1 << 20


class ConvertError(ValueError):
    pass


def _json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: not JSON ({e})") from None
    if not isinstance(out, dict):
        raise ConvertError(f"{path}: not a JSON object")
    return out


def _text_config(folder: Path) -> dict:
    p = folder / "config.json"
    if not p.exists():
        raise ConvertError(f"{folder}: no config.json (expected a transformers checkpoint folder)")
    cfg = _json(p)
    cfg = cfg.get("text_config", cfg)
    arch = cfg.get("model_type", "")
    if arch not in ("qwen4_exp_text", "qwen4_exp"):
        raise ConvertError(f"{p}: model_type is '{arch}', expected a Qwen4-Exp (qwen4_exp_text) checkpoint")
    return cfg


def config_from_hf(hf: dict) -> ModelConfig:
    """The GGUF geometry of a transformers Qwen4ExpTextConfig dict, refusing what qwen4exp cannot express."""
    def need(key: str):
        if hf.get(key) is None:
            raise ConvertError(f"config.json: missing '{key}'")
        return hf[key]

    gate = hf.get("output_gate_type") or hf.get("hidden_act", "silu")
    if gate != "sigmoid":
        raise ConvertError(f"config.json: the GDN output gate is '{gate}'; qwen4exp (and strata) define it as "
                           f"sigmoid (set output_gate_type='sigmoid')")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"config.json: hidden_act '{hf['hidden_act']}' is not silu")
    if not hf.get("norm_topk_prob", True):
        raise ConvertError("config.json: norm_topk_prob is false; qwen4exp renormalizes the top-k weights")
    if hf.get("indexer_kv_heads", 1) != 1:
        raise ConvertError("config.json: indexer_kv_heads must be 1")
    n_layer = need("num_hidden_layers")
    layer_types = hf.get("layer_types") or [
        "linear_attention" if (i + 1) % hf.get("full_attention_interval", 4) else "indexed_attention"
        for i in range(n_layer)]
    recurrent = tuple(t == "linear_attention" for t in layer_types)
    ratio = need("indexer_compress_ratio")
    rp = hf.get("rope_parameters") or {}
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    n_rot = int(head_dim * rp.get("partial_rotary_factor", 1.0))
    sections = list(rp.get("mrope_section", [11, 11, 10]))
    sections = (sections + [0, 0, 0, 0])[:4]
    eos = hf.get("eos_token_id")
    eos = eos[-1] if isinstance(eos, list) else eos

    ple: dict = {}
    ple_ids = hf.get("ple_layer_ids") or []
    if ple_ids:
        if eos is None:
            raise ConvertError("config.json: eos_token_id is required when PLE is enabled (the hash resets on it)")
        n_heads = (hf.get("ngram_size", 3) - 1) * hf.get("heads_per_ngram", 8)
        ple_dim = hf.get("ple_embed_dim") or hf["hidden_size"]
        ple = dict(ple_layers=tuple(i - 1 for i in ple_ids), ple_ngram=hf.get("ngram_size", 3),
                   ple_heads_per_ngram=hf.get("heads_per_ngram", 8), ple_conv=hf.get("ple_conv_kernel_size", 4),
                   ple_eos=int(eos), ple_row=ple_dim // n_heads)
    return ModelConfig(
        n_layer=n_layer, n_embd=need("hidden_size"), n_vocab=need("vocab_size"),
        n_ctx_train=hf.get("max_position_embeddings", 0), rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        n_head=need("num_attention_heads"), n_head_kv=need("num_key_value_heads"), head_dim=head_dim,
        n_rot=n_rot, rope_base=float(rp.get("rope_theta", 10000.0)),
        idx_heads=need("indexer_n_heads"), idx_dim=need("indexer_head_dim"), idx_budget=need("indexer_budget"),
        compress_ratios=tuple(0 if r else ratio for r in recurrent),
        ssm_conv=hf.get("linear_conv_kernel_dim", 4), ssm_state=need("linear_key_head_dim"),
        ssm_k_heads=need("linear_num_key_heads"), ssm_v_heads=need("linear_num_value_heads"), recurrent=recurrent,
        hc=hf.get("hc_count", 4), hc_rank=hf.get("hc_lowrank", 320),
        n_expert=need("num_experts"), n_expert_used=need("num_experts_per_tok"),
        n_ff_exp=need("moe_intermediate_size"), n_ff_shexp=need("shared_expert_intermediate_size"),
        rope_sections=tuple(sections), eos_id=eos, **ple)


@dataclass(frozen=True)
class Part:
    src: str                        # checkpoint tensor
    rows: slice | np.ndarray        # rows of its 2-D view (-1, last dim): a range, or row numbers

    def __len__(self) -> int:
        return self.rows.stop - self.rows.start if isinstance(self.rows, slice) else len(self.rows)


@dataclass(frozen=True)
class Planned:
    """One GGUF tensor: the concatenated rows of `parts`, each row permuted by `cols`, then `fn` (float32)."""
    name: str
    shape: tuple[int, ...]          # numpy order (ggml's reversed); rows are along the last axis
    parts: tuple[Part, ...]
    cols: np.ndarray | None = None
    fn: Callable[[np.ndarray], np.ndarray] | None = None

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64))


def _plus_one(x: np.ndarray) -> np.ndarray:
    return np.add(x, 1, out=x)


def _neg_exp(x: np.ndarray) -> np.ndarray:
    return (-np.exp(x.astype(np.float64))).astype(np.float32)


def _tiled(n_v_heads: int, hk: int, hd: int) -> np.ndarray:
    """Source index of each value-head row/column: grouped by key head (g*r + j) -> tiled (j*Hk + g)."""
    return np.arange(n_v_heads * hd).reshape(hk, n_v_heads // hk, hd).swapaxes(0, 1).reshape(-1)


def _prefix(ck: Checkpoint) -> str:
    return "model.language_model." if any(n.startswith("model.language_model.") for n in ck.names()) else "model."


def plan_tensors(ck: Checkpoint, cfg: ModelConfig) -> list[Planned]:
    """Every GGUF tensor as rows of checkpoint tensors, from the safetensors headers only (no data read)."""
    kd, hd, hk = cfg.key_dim, cfg.ssm_state, cfg.ssm_k_heads
    retile = cfg.ssm_v_heads != hk
    prefix = _prefix(ck)
    plans: list[Planned] = []

    def rows_of(src: str) -> int:
        shape = ck.shape(src)
        return int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1

    def add(dst: str, name: str, shape=None, rows=None, cols=None, fn=None, full: bool = False) -> None:
        """dst from rows `rows` (default: all) of checkpoint tensor prefix + name (or name, when full)."""
        src = name if full else prefix + name
        plans.append(Planned(dst, tuple(shape or ck.shape(src)),
                             (Part(src, slice(0, rows_of(src)) if rows is None else rows),), cols, fn))

    def as_2d(name: str) -> tuple[int, int]:            # conv weights (C, 1, K) -> (C, K)
        return rows_of(prefix + name), ck.shape(prefix + name)[-1]

    def hc(src: str, dst: str, inject: bool) -> None:
        add(f"{dst}_norm.weight", f"{src}.hc_norm.weight", fn=_plus_one)
        add(f"{dst}_down.weight", f"{src}.input_mix_weight_down.weight")
        add(f"{dst}_up.weight", f"{src}.input_mix_weight_up.weight")
        if inject:
            add(f"{dst}_inject.weight", f"{src}.block_inject_weight.weight")

    add("token_embd.weight", "embed_tokens.weight")
    if "lm_head.weight" in ck:
        add("output.weight", "lm_head.weight", full=True)
    hc("hyper_connection_mixer", "output_hc", False)

    v_rows = _tiled(cfg.ssm_v_heads, hk, hd) if retile else None          # over the value_dim rows/columns
    h_rows = _tiled(cfg.ssm_v_heads, hk, 1) if retile else None           # over the Hv heads
    qkv_rows = np.concatenate([np.arange(2 * kd), 2 * kd + v_rows]) if retile else None
    for il in range(cfg.n_layer):
        L, b = f"layers.{il}.", f"blk.{il}."
        hc(L + "attn_hyper_connection", b + "hc_attn", True)
        hc(L + "mlp_hyper_connection", b + "hc_ffn", True)
        if cfg.recurrent[il]:
            a = L + "linear_attn."
            add(b + "attn_qkv.weight", a + "in_proj_qkv.weight", rows=qkv_rows)
            add(b + "attn_gate.weight", a + "in_proj_z.weight", rows=v_rows)
            add(b + "ssm_conv1d.weight", a + "conv1d.weight", shape=as_2d(a + "conv1d.weight"), rows=qkv_rows)
            add(b + "ssm_dt.bias", a + "dt_bias", cols=h_rows)
            add(b + "ssm_a", a + "A_log", cols=h_rows, fn=_neg_exp)
            add(b + "ssm_alpha.weight", a + "in_proj_a.weight", rows=h_rows)
            add(b + "ssm_beta.weight", a + "in_proj_b.weight", rows=h_rows)
            add(b + "ssm_norm.weight", a + "norm.weight")
            add(b + "ssm_out.weight", a + "out_proj.weight", cols=v_rows)
        else:
            a = L + "self_attn."
            add(b + "attn_q.weight", a + "q_proj.weight")
            add(b + "attn_k.weight", a + "k_proj.weight")
            add(b + "attn_v.weight", a + "v_proj.weight")
            add(b + "attn_output.weight", a + "o_proj.weight")
            add(b + "attn_q_norm.weight", a + "q_norm.weight", fn=_plus_one)
            add(b + "attn_k_norm.weight", a + "k_norm.weight", fn=_plus_one)
            qk = a + "indexer.index_qk_proj.weight"
            n_q, n_qk, E = cfg.idx_heads * cfg.idx_dim, rows_of(prefix + qk), ck.shape(prefix + qk)[-1]
            add(b + "indexer.q_proj.weight", qk, shape=(n_q, E), rows=slice(0, n_q))
            add(b + "indexer.k_proj.weight", qk, shape=(n_qk - n_q, E), rows=slice(n_q, n_qk))
            add(b + "indexer.q_norm.weight", a + "indexer.q_layernorm.weight", fn=_plus_one)
            add(b + "indexer.k_norm.weight", a + "indexer.k_layernorm.weight", fn=_plus_one)
        if il in cfg.ple_layers:
            p = L + "ple."
            add(b + "ple_key.weight", p + "key_proj.weight")
            add(b + "ple_value.weight", p + "value_proj.weight")
            add(b + "ple_norm_key.weight", p + "norm_key.weight", fn=_plus_one)
            add(b + "ple_norm_query.weight", p + "norm_query.weight", fn=_plus_one)
            add(b + "ple_norm_conv.weight", p + "norm_conv.weight", fn=_plus_one)
            add(b + "ple_conv1d.weight", p + "conv1d.weight", shape=as_2d(p + "conv1d.weight"))
        m = L + "mlp."
        add(b + "ffn_gate_inp.weight", m + "gate.weight")
        plans.extend(_experts(ck, prefix + m, b, cfg))
        add(b + "ffn_gate_inp_shexp.weight", m + "shared_expert_gate.weight",
            shape=(int(np.prod(ck.shape(prefix + m + "shared_expert_gate.weight"))),))
        add(b + "ffn_gate_shexp.weight", m + "shared_expert.gate_proj.weight")
        add(b + "ffn_up_shexp.weight", m + "shared_expert.up_proj.weight")
        add(b + "ffn_down_shexp.weight", m + "shared_expert.down_proj.weight")

    if cfg.ple_layers:
        plans.append(_ple_table(ck, prefix, cfg))
    return plans


def _experts(ck: Checkpoint, mlp: str, b: str, cfg: ModelConfig) -> list[Planned]:
    """Stacked gate (n, F, E), up (n, F, E), down (n, E, F): from the fused runtime layout (gate_up_proj
    (n, 2F, E), down_proj (n, E, F)) or from per-expert tensors, one Part per expert."""
    n, F = cfg.n_expert, cfg.n_ff_exp
    if mlp + "experts.gate_up_proj" in ck:
        gu, down = mlp + "experts.gate_up_proj", mlp + "experts.down_proj"
        _, two_f, E = ck.shape(gu)
        gate = tuple(Part(gu, slice(e * two_f, e * two_f + F)) for e in range(n))
        up = tuple(Part(gu, slice(e * two_f + F, (e + 1) * two_f)) for e in range(n))
        d_shape = ck.shape(down)
        return [Planned(b + "ffn_gate_exps.weight", (n, F, E), gate),
                Planned(b + "ffn_up_exps.weight", (n, two_f - F, E), up),
                Planned(b + "ffn_down_exps.weight", d_shape,
                        (Part(down, slice(0, int(np.prod(d_shape[:-1], dtype=np.int64)))),))]
    out = []
    for k, dst in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
        names = [f"{mlp}experts.{e}.{k}_proj.weight" for e in range(n)]
        shape = ck.shape(names[0])
        for name in names:
            if ck.shape(name) != shape:
                raise ConvertError(f"checkpoint tensor '{name}' has shape {list(ck.shape(name))}, expert 0's "
                                   f"is {list(shape)}")
        out.append(Planned(f"{b}{dst}.weight", (n, *shape), tuple(Part(x, slice(0, shape[0])) for x in names)))
    return out


def _ple_table(ck: Checkpoint, prefix: str, cfg: ModelConfig) -> Planned:
    """The n-gram table (rows, ple_row): the checkpoint's shards concatenated in index order."""
    stem = f"{prefix}layers.{cfg.ple_layers[0]}.ple.ple_embedding.ngram_embedding."
    if stem + "weight" in ck:
        names = [stem + "weight"]
    else:
        shards = sorted((int(n[len(stem) + 6:].split(".")[0]), n) for n in ck.names()
                        if n.startswith(stem + "shard_") and n.endswith(".weight"))
        names = [n for _, n in shards]
    if not names:
        raise ConvertError(f"checkpoint has no PLE table ('{stem}weight' or '{stem}shard_N.weight')")
    parts = tuple(Part(n, slice(0, ck.shape(n)[0])) for n in names)
    return Planned("per_layer_token_embd.weight", (sum(map(len, parts)), ck.shape(names[0])[-1]), parts)


def check_plan(ck: Checkpoint, plans: list[Planned], cfg: ModelConfig) -> None:
    """Every planned tensor has a shape the schema accepts and rows its sources hold, before a byte is written."""
    specs = {s.name: s for s in all_specs(cfg)}
    for p in plans:
        srcs = sorted({part.src for part in p.parts})
        where = f"'{srcs[0]}'" + (f" (and {len(srcs) - 1} more)" if len(srcs) > 1 else "")
        for part in p.parts:
            shape = ck.shape(part.src)
            n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
            rows = part.rows
            top = rows.stop if isinstance(rows, slice) else (int(rows.max()) + 1 if len(rows) else 0)
            if (shape[-1] if shape else 1) != p.shape[-1] or top > n_rows:
                raise ConvertError(f"checkpoint tensor '{part.src}' has shape {list(shape)}, which does not give "
                                   f"{p.name} (numpy shape {list(p.shape)}) under config.json")
        if sum(map(len, p.parts)) != p.n_rows:
            raise ConvertError(f"{where}: {sum(map(len, p.parts))} rows for {p.name} (numpy shape {list(p.shape)})")
        if p.cols is not None and len(p.cols) != p.shape[-1]:
            raise ConvertError(f"{where}: rows of {p.shape[-1]} for {p.name}, config.json implies {len(p.cols)}")
        ggml = tuple(reversed(p.shape))
        want = specs[p.name].shapes
        if p.name == "per_layer_token_embd.weight" and ggml[0] == want[0][0] and ggml[1] >= want[0][1]:
            continue                            # the table may be padded past the hash ranges (as the loader says)
        if ggml not in want:
            raise ConvertError(f"{where} gives {p.name} the ggml shape {list(ggml)}; config.json implies "
                               f"{list(specs[p.name].shapes[0])}")
    have = {p.name for p in plans}
    missing = [s.name for s in specs.values() if s.required and s.name not in have]
    if missing:
        raise ConvertError(f"the checkpoint gives no {missing[0]}")


def row_chunks(n_rows: int, row_len: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of about CHUNK_ELEMENTS values each (at least one row)."""
    per = max(1, CHUNK_ELEMENTS // max(row_len, 1))
    return [(lo, min(n_rows, lo + per)) for lo in range(0, n_rows, per)]


def read_rows(ck: Checkpoint, p: Planned, lo: int, hi: int, dtype: type = np.float32) -> np.ndarray:
    """Rows [lo, hi) of planned tensor p as float32 (hi - lo, row), transformed; dtype uint16: the bits of
    BF16 sources as stored (for a BF16 output, which then needs no rounding)."""
    out = np.empty((hi - lo, p.shape[-1]), dtype)
    start = 0
    for part in p.parts:
        end = start + len(part)
        a, b = max(lo, start), min(hi, end)
        if a < b:
            r = part.rows
            sub = slice(r.start + a - start, r.start + b - start) if isinstance(r, slice) else r[a - start:b - start]
            ck.rows(part.src, sub, out=out[a - lo:b - lo])
        start = end
        if start >= hi:
            break
    if p.cols is not None:
        out = out[:, p.cols]
    return p.fn(out) if p.fn is not None else out


def pipelined(make: Callable[[int], np.ndarray], n: int, pool: ThreadPoolExecutor | None,
              ahead: int) -> Iterator[np.ndarray]:
    """make(0), ..., make(n - 1) in order, at most `ahead` computed ahead on `pool` (memory: ahead chunks)."""
    if pool is None:
        for i in range(n):
            yield make(i)
        return
    futs = {i: pool.submit(make, i) for i in range(min(ahead, n))}
    for i in range(n):
        chunk = futs.pop(i).result()
        if i + ahead < n:
            futs[i + ahead] = pool.submit(make, i + ahead)
        yield chunk


def hash_constants(ck: Checkpoint, hf: dict, cfg: ModelConfig) -> dict:
    """The int64 hash constants from the checkpoint (exact), derived the transformers way where absent."""
    stem = f"{_prefix(ck)}layers.{cfg.ple_layers[0]}.ple.ple_embedding."
    n_heads = cfg.ple_heads
    if stem + "layer_multipliers" in ck:
        return dict(ple_multipliers=tuple(int(v) for v in ck.get(stem + "layer_multipliers")),
                    ple_offsets=tuple(int(v) for v in ck.get(stem + "ngram_heads_offsets")),
                    ple_vocab_sizes=tuple(int(v) for v in ck.get(stem + "ngram_heads_vocab_sizes")))
    sizes = ple_hash.head_vocab_sizes(hf.get("ngram_vocab_size_base", 20_000_000), n_heads)
    return dict(ple_multipliers=tuple(ple_hash.layer_multipliers(cfg.n_vocab, cfg.ple_ngram, 0, hf.get("seed", 1234))),
                ple_offsets=tuple(ple_hash.head_offsets(sizes)), ple_vocab_sizes=tuple(sizes))




def chat_templates(folder: Path, tokenizer_config: dict) -> dict:
    """The checkpoint's chat templates as GGUF keys, found where transformers looks: chat_template.jinja (with
    additional_chat_templates/NAME.jinja) before tokenizer_config.json's chat_template (a string, or a list of
    {name, template}), then a legacy chat_template.json. The default one is tokenizer.chat_template, the others
    tokenizer.chat_template.NAME, listed in tokenizer.chat_templates, as llama.cpp's gguf writer names them."""
    named: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        named["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        for f in sorted((folder / "additional_chat_templates").glob("*.jinja")):
            named[f.stem] = f.read_text(encoding="utf-8")
    else:
        t = tokenizer_config.get("chat_template")
        if t is None and (folder / "chat_template.json").is_file():
            t = _json(folder / "chat_template.json").get("chat_template")
        if isinstance(t, str):
            named["default"] = t
        elif isinstance(t, list) and all(isinstance(c, dict) and {"name", "template"} <= set(c) for c in t):
            named = {c["name"]: c["template"] for c in t}
        elif t is not None:
            raise ConvertError(f"{folder}: chat_template is a {type(t).__name__}, neither a string nor a list of "
                               f"{{name, template}}")
    meta: dict = {}
    others = []
    for name, text in named.items():
        if name == "default":
            meta["tokenizer.chat_template"] = text
        else:
            name = "".join(c if c.isascii() and c.isalnum() else "_" for c in name)
            meta[f"tokenizer.chat_template.{name}"] = text
            others.append(name)
    if others:
        meta["tokenizer.chat_templates"] = others
    return meta


def tokenizer_metadata_from_hf(folder: Path, n_vocab: int, eos: int | None) -> dict:
    """GGUF tokenizer keys from a transformers tokenizer.json (byte-level BPE), padded to the model's vocab, and
    tokenizer_config.json's special tokens and chat template."""
    tc_path = folder / "tokenizer_config.json"
    tokenizer_config = _json(tc_path) if tc_path.is_file() else {}
    try:
        tok = from_hf_tokenizer_json(_json(folder / "tokenizer.json"), n_vocab, eos, tokenizer_config)
    except TokenizerError as e:
        raise ConvertError(f"{folder / 'tokenizer.json'}: {e}") from None
    return {**tok, **chat_templates(folder, tokenizer_config)}


def write_metadata(w: GGUFStreamWriter, cfg: ModelConfig, tok: dict, name: str) -> None:
    from gguf import GGUFValueType as VT
    w.add("general.name", VT.STRING, name)
    for key, vt, value, sub in cfg.to_metadata():
        w.add(key, vt, value, sub)
    for key, value in tok.items():
        if isinstance(value, list):
            sub = VT.INT32 if value and not isinstance(value[0], str) else VT.STRING
            w.add(key, VT.ARRAY, value, sub)
        elif isinstance(value, bool):
            w.add(key, VT.BOOL, value)
        elif isinstance(value, int):
            w.add(key, VT.UINT32, value)
        else:
            w.add(key, VT.STRING, value)


def tensor_type(name: str, n_in: int, out: QType, vector_names: set[str]) -> QType:
    """Vectors (norms, biases, conv taps) stay F32 as llama.cpp keeps them; matrices take the chosen type."""
    if name in vector_names or out == QType.F32:
        return QType.F32
    if n_in % block_size(out):
        return QType.F16
    return out


def _source(ck: Checkpoint, p: Planned, qt: QType, pool: ThreadPoolExecutor | None,
            ahead: int) -> Callable[[], Iterator[np.ndarray]]:
    """The writer's source for p: its rows read, transformed and quantized chunk by chunk."""
    chunks = row_chunks(p.n_rows, p.shape[-1])
    bits = qt == QType.BF16 and p.fn is None and all(ck.dtype(part.src) == "BF16" for part in p.parts)

    def make(i: int) -> np.ndarray:
        if bits:                    # bf16 -> BF16 moves bits: rounding exact values costs most of the time
            return read_rows(ck, p, *chunks[i], dtype=np.uint16)
        return quantize(read_rows(ck, p, *chunks[i]), qt)

    return lambda: pipelined(make, len(chunks), pool, ahead)


def convert(hf_dir: str | os.PathLike, out_path: str | os.PathLike, outtype: str = "f32", *,
            mix: str | None = None, threads: int | None = None, log: Callable[[str], None] = print,
            progress: Callable[[str, int, int], None] | None = None) -> ModelConfig:
    """Write the GGUF of a checkpoint folder: matrices in `outtype`, or in the types `mix` (make-model's
    mixes: f32, bf16, q8_0, realistic) gives them. `progress(tensor, bytes done, bytes total)` per chunk."""
    from strata.model.synth import MIXES, pick_type      # synth imports this module
    folder = Path(hf_dir)
    if not folder.is_dir():
        raise ConvertError(f"{folder}: no such folder (expected a transformers checkpoint folder)")
    if not Path(out_path).parent.is_dir():
        raise ConvertError(f"{out_path}: the folder {Path(out_path).parent} does not exist")
    if outtype not in OUT_TYPES:
        raise ConvertError(f"--outtype {outtype!r}: choose one of {', '.join(OUT_TYPES)}")
    if mix is not None and mix not in MIXES:
        raise ConvertError(f"unknown mix {mix!r}: choose one of {', '.join(MIXES)}")
    hf = _text_config(folder)
    try:
        ck = Checkpoint(folder)
        cfg = config_from_hf(hf)
        if cfg.ple_layers:
            cfg = ModelConfig(**{**cfg.summary(), **hash_constants(ck, hf, cfg)})
        cfg.validate()
        plans = plan_tensors(ck, cfg)
        check_plan(ck, plans, cfg)
    except CheckpointError as e:
        raise ConvertError(str(e)) from None

    if (folder / "tokenizer.json").exists():
        tok = tokenizer_metadata_from_hf(folder, cfg.n_vocab, cfg.eos_id)
    else:
        warnings.warn(f"{folder}: no tokenizer.json; writing strata's small synthetic BPE tokenizer "
                      f"({cfg.n_vocab} tokens, EOS {cfg.eos_id})", stacklevel=2)
        # the synthetic vocab keeps ids 0-255 for bytes; an EOS there stays the model's (PLE) EOS only
        eos = cfg.eos_id if cfg.eos_id is not None and 256 <= cfg.eos_id < cfg.n_vocab else cfg.n_vocab - 1
        tc_path = folder / "tokenizer_config.json"
        tok = {**build_vocab(cfg.n_vocab, eos), **chat_templates(folder, _json(tc_path) if tc_path.is_file() else {})}

    vector_names = {s.name for s in all_specs(cfg) if s.vector}

    def qtype(p: Planned) -> QType:
        if mix is not None:
            return QType.F32 if p.name in vector_names else pick_type(p.name, p.shape[-1], mix)
        return tensor_type(p.name, p.shape[-1], OUT_TYPES[outtype], vector_names)

    w = GGUFStreamWriter(out_path)
    write_metadata(w, cfg, tok, folder.name)
    workers = threads or os.cpu_count() or 1
    with ThreadPoolExecutor(workers) if workers > 1 else nullcontext() as pool:
        for p in plans:
            w.add_tensor(p.name, tuple(reversed(p.shape)), qtype(p), _source(ck, p, qtype(p), pool, workers + 1))
        size = w.write(progress)
    used = {part.src for p in plans for part in p.parts}
    skipped = [n for n in ck.names() if n not in used and "ple_embedding." not in n]
    log(f"wrote {out_path}: {len(plans)} tensors, {size / 2**20:.1f} MiB, arch {ARCH}, matrices "
        f"{'mix ' + mix if mix else OUT_TYPES[outtype].name}"
        + (f"; {len(skipped)} checkpoint tensors not in the schema left out (first: {skipped[0]})" if skipped else ""))
    return cfg

