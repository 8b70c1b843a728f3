"""`cli.py convert HF_DIR OUT.gguf`: a transformers Qwen4-Exp checkpoint -> the llama.cpp qwen4exp schema.

What it does to the weights is what llama.cpp's converter does (conversion/qwen4exp.py, qwen.py), so files
from either converter hold the same numbers:
- zero-centred RMSNorm gammas are stored as (1 + w) (hc, attention q/k, indexer q/k, PLE norms; not the GDN
  gated norm);
- ssm_a = -exp(A_log); dt_bias -> ssm_dt.bias; conv weights squeezed to (channels, K);
- the indexer's fused index_qk_proj is split into q_proj and k_proj;
- GDN value heads are reordered from grouped-by-key-head to tiled (value head h uses key head h % Hk).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from strata.config import ARCH, ModelConfig
from strata.model import ple_hash
from strata.model.gguf_writer import GGUFStreamWriter
from strata.model.safetensors_file import Checkpoint, CheckpointError
from strata.model.schema import all_specs
from strata.quant import QType, block_size, quantize
from strata.tokenizer import build_vocab

OUT_TYPES = {"f32": QType.F32, "f16": QType.F16, "bf16": QType.BF16, "q8_0": QType.Q8_0}


class ConvertError(ValueError):
    pass


def _text_config(folder: Path) -> dict:
    p = folder / "config.json"
    if not p.exists():
        raise ConvertError(f"{folder}: no config.json (expected a transformers checkpoint folder)")
    cfg = json.loads(p.read_text())
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


def _reorder_v(t: np.ndarray, axis: int, hk: int, hd: int) -> np.ndarray:
    """Value heads along `axis`: grouped by key head (g*r + j) -> tiled (j*Hk + g)."""
    t = np.moveaxis(t, axis, 0)
    n = t.shape[0] // hd                                   # value heads
    r = n // hk
    t = t.reshape(hk, r, hd, *t.shape[1:]).swapaxes(0, 1).reshape(n * hd, *t.shape[1:])
    return np.moveaxis(t, 0, axis)


def hf_tensors(ck: Checkpoint, hf: dict, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, numpy array in GGUF numpy order) for every tensor, transformed as llama.cpp's converter does."""
    kd, hd, hk = cfg.key_dim, cfg.ssm_state, cfg.ssm_k_heads
    retile = cfg.ssm_v_heads != cfg.ssm_k_heads
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in ck.names()) else "model."

    def g(name: str) -> np.ndarray:
        return ck.get(prefix + name)

    def hc(src: str, dst: str, inject: bool):
        yield f"{dst}_norm.weight", g(f"{src}.hc_norm.weight") + 1
        yield f"{dst}_down.weight", g(f"{src}.input_mix_weight_down.weight")
        yield f"{dst}_up.weight", g(f"{src}.input_mix_weight_up.weight")
        if inject:
            yield f"{dst}_inject.weight", g(f"{src}.block_inject_weight.weight")

    yield "token_embd.weight", g("embed_tokens.weight")
    if "lm_head.weight" in ck:
        yield "output.weight", ck.get("lm_head.weight")
    yield from hc("hyper_connection_mixer", "output_hc", False)

    for il in range(cfg.n_layer):
        L, b = f"layers.{il}.", f"blk.{il}."
        yield from hc(L + "attn_hyper_connection", b + "hc_attn", True)
        yield from hc(L + "mlp_hyper_connection", b + "hc_ffn", True)
        if cfg.recurrent[il]:
            a = L + "linear_attn."
            qkv, z = g(a + "in_proj_qkv.weight"), g(a + "in_proj_z.weight")
            conv = g(a + "conv1d.weight").reshape(cfg.conv_dim, -1)
            alpha, beta = g(a + "in_proj_a.weight"), g(a + "in_proj_b.weight")
            dt, A = g(a + "dt_bias"), g(a + "A_log")
            out = g(a + "out_proj.weight")
            if retile:
                qkv = np.concatenate([qkv[:2 * kd], _reorder_v(qkv[2 * kd:], 0, hk, hd)])
                conv = np.concatenate([conv[:2 * kd], _reorder_v(conv[2 * kd:], 0, hk, hd)])
                z = _reorder_v(z, 0, hk, hd)
                alpha, beta = _reorder_v(alpha, 0, hk, 1), _reorder_v(beta, 0, hk, 1)
                dt, A = _reorder_v(dt, 0, hk, 1), _reorder_v(A, 0, hk, 1)
                out = _reorder_v(out, 1, hk, hd)
            yield b + "attn_qkv.weight", qkv
            yield b + "attn_gate.weight", z
            yield b + "ssm_conv1d.weight", conv
            yield b + "ssm_dt.bias", dt
            yield b + "ssm_a", -np.exp(A.astype(np.float64)).astype(np.float32)
            yield b + "ssm_alpha.weight", alpha
            yield b + "ssm_beta.weight", beta
            yield b + "ssm_norm.weight", g(a + "norm.weight")
            yield b + "ssm_out.weight", out
        else:
            a = L + "self_attn."
            yield b + "attn_q.weight", g(a + "q_proj.weight")
            yield b + "attn_k.weight", g(a + "k_proj.weight")
            yield b + "attn_v.weight", g(a + "v_proj.weight")
            yield b + "attn_output.weight", g(a + "o_proj.weight")
            yield b + "attn_q_norm.weight", g(a + "q_norm.weight") + 1
            yield b + "attn_k_norm.weight", g(a + "k_norm.weight") + 1
            qk = g(a + "indexer.index_qk_proj.weight")
            n_q = cfg.idx_heads * cfg.idx_dim
            yield b + "indexer.q_proj.weight", qk[:n_q]
            yield b + "indexer.k_proj.weight", qk[n_q:]
            yield b + "indexer.q_norm.weight", g(a + "indexer.q_layernorm.weight") + 1
            yield b + "indexer.k_norm.weight", g(a + "indexer.k_layernorm.weight") + 1
        if il in cfg.ple_layers:
            p = L + "ple."
            yield b + "ple_key.weight", g(p + "key_proj.weight")
            yield b + "ple_value.weight", g(p + "value_proj.weight")
            yield b + "ple_norm_key.weight", g(p + "norm_key.weight") + 1
            yield b + "ple_norm_query.weight", g(p + "norm_query.weight") + 1
            yield b + "ple_norm_conv.weight", g(p + "norm_conv.weight") + 1
            yield b + "ple_conv1d.weight", g(p + "conv1d.weight").reshape(cfg.hc_dim, -1)
        m = L + "mlp."
        yield b + "ffn_gate_inp.weight", g(m + "gate.weight")
        gate, up, down = experts(ck, prefix + m, cfg)
        yield b + "ffn_gate_exps.weight", gate
        yield b + "ffn_up_exps.weight", up
        yield b + "ffn_down_exps.weight", down
        yield b + "ffn_gate_inp_shexp.weight", g(m + "shared_expert_gate.weight").reshape(-1)
        yield b + "ffn_gate_shexp.weight", g(m + "shared_expert.gate_proj.weight")
        yield b + "ffn_up_shexp.weight", g(m + "shared_expert.up_proj.weight")
        yield b + "ffn_down_shexp.weight", g(m + "shared_expert.down_proj.weight")

    if cfg.ple_layers:
        yield "per_layer_token_embd.weight", ple_table(ck, prefix, cfg)


def experts(ck: Checkpoint, mlp: str, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stacked (gate (n, F, E), up (n, F, E), down (n, E, F)) from the fused runtime layout or per-expert tensors."""
    if mlp + "experts.gate_up_proj" in ck:
        gu = ck.get(mlp + "experts.gate_up_proj")                  # (n_exp, 2F, E)
        return gu[:, :cfg.n_ff_exp], gu[:, cfg.n_ff_exp:], ck.get(mlp + "experts.down_proj")
    per = [[ck.get(f"{mlp}experts.{e}.{k}_proj.weight") for e in range(cfg.n_expert)] for k in ("gate", "up", "down")]
    return tuple(np.stack(p) for p in per)


def ple_table(ck: Checkpoint, prefix: str, cfg: ModelConfig) -> np.ndarray:
    """The n-gram table (rows, ple_row): the checkpoint's shards concatenated in index order."""
    stem = f"{prefix}layers.{cfg.ple_layers[0]}.ple.ple_embedding.ngram_embedding."
    if stem + "weight" in ck:
        return ck.get(stem + "weight")
    shards = sorted((int(n[len(stem) + 6:].split(".")[0]), n) for n in ck.names() if n.startswith(stem + "shard_"))
    if not shards:
        raise ConvertError(f"checkpoint has no PLE table ('{stem}weight' or '{stem}shard_N.weight')")
    return np.concatenate([ck.get(n) for _, n in shards])


def hash_constants(ck: Checkpoint, hf: dict, cfg: ModelConfig) -> dict:
    """The int64 hash constants from the checkpoint (exact), derived the transformers way where absent."""
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in ck.names()) else "model."
    stem = f"{prefix}layers.{cfg.ple_layers[0]}.ple.ple_embedding."
    n_heads = cfg.ple_heads
    if stem + "layer_multipliers" in ck:
        return dict(ple_multipliers=tuple(int(v) for v in ck.get(stem + "layer_multipliers")),
                    ple_offsets=tuple(int(v) for v in ck.get(stem + "ngram_heads_offsets")),
                    ple_vocab_sizes=tuple(int(v) for v in ck.get(stem + "ngram_heads_vocab_sizes")))
    sizes = ple_hash.head_vocab_sizes(hf.get("ngram_vocab_size_base", 20_000_000), n_heads)
    return dict(ple_multipliers=tuple(ple_hash.layer_multipliers(cfg.n_vocab, cfg.ple_ngram, 0, hf.get("seed", 1234))),
                ple_offsets=tuple(ple_hash.head_offsets(sizes)), ple_vocab_sizes=tuple(sizes))


def tokenizer_metadata_from_hf(folder: Path, n_vocab: int, eos: int | None) -> dict:
    """GGUF tokenizer keys from a transformers tokenizer.json (byte-level BPE), padded to the model's vocab."""
    tj = json.loads((folder / "tokenizer.json").read_text())
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise ConvertError(f"{folder}/tokenizer.json: model type {model.get('type')!r}, expected BPE (byte-level)")
    tokens: list[str | None] = [None] * n_vocab
    types = [1] * n_vocab                                   # NORMAL
    for text, i in model["vocab"].items():
        if i < n_vocab:
            tokens[i] = text
    for added in tj.get("added_tokens", []):
        if added["id"] < n_vocab:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = 3 if added.get("special") else 4   # CONTROL / USER_DEFINED
    for i, t in enumerate(tokens):
        if t is None:
            tokens[i], types[i] = f"[PAD{i}]", 5                      # UNUSED, as llama.cpp's converter pads
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    pattern = json.dumps(tj.get("pre_tokenizer"))
    if "p{M}" in pattern:
        pre = "qwen35"
    elif "p{L}" in pattern:
        pre = "qwen2"
    else:
        raise ConvertError(f"{folder}/tokenizer.json: unrecognized pre-tokenizer {pattern[:200]}: strata knows "
                           f"Qwen's (qwen2, qwen35)")
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges, "tokenizer.ggml.add_bos_token": False}
    if eos is not None:
        meta["tokenizer.ggml.eos_token_id"] = int(eos)
    return meta


def write_metadata(w: GGUFStreamWriter, cfg: ModelConfig, tok: dict, name: str) -> None:
    from gguf import GGUFValueType as VT
    w.add("general.name", VT.STRING, name)
    for key, vt, value, sub in cfg.to_metadata():
        w.add(key, vt, value, sub)
    for key, value in tok.items():
        if isinstance(value, list):
            sub = VT.STRING if value and isinstance(value[0], str) else VT.INT32
            w.add(key, VT.ARRAY, value, sub)
        elif isinstance(value, bool):
            w.add(key, VT.BOOL, value)
        elif isinstance(value, int):
            w.add(key, VT.UINT32, value)
        else:
            w.add(key, VT.STRING, value)


def tensor_type(name: str, arr: np.ndarray, out: QType, vector_names: set[str]) -> QType:
    """Vectors (norms, biases, conv taps) stay F32 as llama.cpp keeps them; matrices take the chosen type."""
    if name in vector_names or out == QType.F32:
        return QType.F32
    if arr.shape[-1] % block_size(out):
        return QType.F16
    return out


def convert(hf_dir: str | Path, out_path: str | Path, outtype: str = "f32",
            log: Callable[[str], None] = print) -> ModelConfig:
    folder = Path(hf_dir)
    if outtype not in OUT_TYPES:
        raise ConvertError(f"--outtype {outtype!r}: choose one of {', '.join(OUT_TYPES)}")
    hf = _text_config(folder)
    try:
        ck = Checkpoint(folder)
    except CheckpointError as e:
        raise ConvertError(str(e)) from None
    cfg = config_from_hf(hf)
    if cfg.ple_layers:
        cfg = ModelConfig(**{**cfg.summary(), **hash_constants(ck, hf, cfg)})
    cfg.validate()

    if (folder / "tokenizer.json").exists():
        tok = tokenizer_metadata_from_hf(folder, cfg.n_vocab, cfg.eos_id)
    else:
        warnings.warn(f"{folder}: no tokenizer.json; writing strata's small synthetic BPE tokenizer "
                      f"({cfg.n_vocab} tokens, EOS {cfg.eos_id})", stacklevel=2)
        # the synthetic vocab keeps ids 0-255 for bytes; an EOS there stays the model's (PLE) EOS only
        eos = cfg.eos_id if cfg.eos_id is not None and 256 <= cfg.eos_id < cfg.n_vocab else cfg.n_vocab - 1
        tok = build_vocab(cfg.n_vocab, eos)

    qt = OUT_TYPES[outtype]
    vector_names = {s.name for s in all_specs(cfg) if s.vector}
    w = GGUFStreamWriter(out_path)
    write_metadata(w, cfg, tok, folder.name)
    arrays = dict(hf_tensors(ck, hf, cfg))
    for name, arr in arrays.items():
        t = tensor_type(name, arr, qt, vector_names)
        ggml_shape = tuple(reversed(arr.shape))
        data = np.ascontiguousarray(arr, dtype=np.float32)
        w.add_tensor(name, ggml_shape, t, quantize(data.reshape(-1, data.shape[-1]), t))
    size = w.write()
    log(f"wrote {out_path}: {len(arrays)} tensors, {size / 2**20:.1f} MiB, arch {ARCH}, matrices {qt.name}")
    return cfg
