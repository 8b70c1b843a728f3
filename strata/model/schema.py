"""The llama.cpp qwen4exp tensor schema: every tensor's name and ggml shape as functions of ModelConfig.

Shapes are ggml order (row length first), exactly as llama.cpp's `load_arch_tensors` creates them. A tensor
may have alternatives: the grouped-norm gammas load as [hc*E] or [E, hc]; the shared-expert gate as [E] or
[E, 1]; the gate/up expert pair may be fused into `ffn_gate_up_exps`; `output` falls back to `token_embd`.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.config import ModelConfig

# 1-D tensors must be plain floats: strata reads them whole at load time.
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class Spec:
    name: str
    shapes: tuple[tuple[int, ...], ...]   # accepted ggml shapes, the first is canonical
    required: bool = True
    vector: bool = False                  # norms, biases, per-head scalars: float types only


def _norm(name: str, cfg: ModelConfig) -> Spec:
    return Spec(name, ((cfg.hc_dim,), (cfg.n_embd, cfg.hc)), vector=True)


def _hc(prefix: str, cfg: ModelConfig, inject: bool) -> list[Spec]:
    specs = [
        _norm(f"{prefix}_norm.weight", cfg),
        Spec(f"{prefix}_down.weight", ((cfg.hc_dim, cfg.hc_rank),)),
        Spec(f"{prefix}_up.weight", ((cfg.hc_rank, cfg.hc_dim),)),
    ]
    if inject:
        specs.append(Spec(f"{prefix}_inject.weight", ((cfg.hc_dim, cfg.hc),)))
    return specs


def layer_specs(cfg: ModelConfig, il: int) -> list[Spec]:
    """The tensors of block `il`. Fused expert gate/up is listed as optional beside the pair (see `check`)."""
    b = f"blk.{il}."
    E, ff, n_exp = cfg.n_embd, cfg.n_ff_exp, cfg.n_expert
    specs = _hc(b + "hc_attn", cfg, True) + _hc(b + "hc_ffn", cfg, True)
    if cfg.recurrent[il]:
        Hv, Dv, vd = cfg.ssm_v_heads, cfg.ssm_state, cfg.value_dim
        specs += [
            Spec(b + "attn_qkv.weight", ((E, cfg.conv_dim),)),
            Spec(b + "attn_gate.weight", ((E, vd),)),
            Spec(b + "ssm_conv1d.weight", ((cfg.ssm_conv, cfg.conv_dim),), vector=True),
            Spec(b + "ssm_dt.bias", ((Hv,),), vector=True),
            Spec(b + "ssm_a", ((Hv,),), vector=True),
            Spec(b + "ssm_alpha.weight", ((E, Hv),)),
            Spec(b + "ssm_beta.weight", ((E, Hv),)),
            Spec(b + "ssm_norm.weight", ((Dv,),), vector=True),
            Spec(b + "ssm_out.weight", ((vd, E),)),
        ]
    else:
        H, Hkv, D, Hi, Di = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.idx_heads, cfg.idx_dim
        specs += [
            Spec(b + "attn_q.weight", ((E, 2 * H * D),)),
            Spec(b + "attn_k.weight", ((E, Hkv * D),)),
            Spec(b + "attn_v.weight", ((E, Hkv * D),)),
            Spec(b + "attn_output.weight", ((H * D, E),)),
            Spec(b + "attn_q_norm.weight", ((D,),), vector=True),
            Spec(b + "attn_k_norm.weight", ((D,),), vector=True),
            Spec(b + "indexer.q_proj.weight", ((E, Hi * Di),)),
            Spec(b + "indexer.k_proj.weight", ((E, Di),)),
            Spec(b + "indexer.q_norm.weight", ((Di,),), vector=True),
            Spec(b + "indexer.k_norm.weight", ((Di,),), vector=True),
        ]
    if il in cfg.ple_layers:
        specs += [
            Spec(b + "ple_key.weight", ((cfg.ple_dim, cfg.hc_dim),)),
            Spec(b + "ple_value.weight", ((cfg.ple_dim, E),)),
            _norm(b + "ple_norm_key.weight", cfg),
            _norm(b + "ple_norm_query.weight", cfg),
            _norm(b + "ple_norm_conv.weight", cfg),
            Spec(b + "ple_conv1d.weight", ((cfg.ple_conv, cfg.hc_dim),), vector=True),
        ]
    specs += [
        Spec(b + "ffn_gate_inp.weight", ((E, n_exp),)),
        Spec(b + "ffn_gate_exps.weight", ((E, ff, n_exp),)),
        Spec(b + "ffn_up_exps.weight", ((E, ff, n_exp),)),
        Spec(b + "ffn_gate_up_exps.weight", ((E, 2 * ff, n_exp),), required=False),
        Spec(b + "ffn_down_exps.weight", ((ff, E, n_exp),)),
        Spec(b + "ffn_gate_inp_shexp.weight", ((E,), (E, 1)), vector=True),
        Spec(b + "ffn_gate_shexp.weight", ((E, cfg.n_ff_shexp),)),
        Spec(b + "ffn_up_shexp.weight", ((E, cfg.n_ff_shexp),)),
        Spec(b + "ffn_down_shexp.weight", ((cfg.n_ff_shexp, E),)),
    ]
    return specs


def global_specs(cfg: ModelConfig) -> list[Spec]:
    specs = [
        Spec("token_embd.weight", ((cfg.n_embd, cfg.n_vocab),)),
        Spec("output.weight", ((cfg.n_embd, cfg.n_vocab),), required=False),
        *_hc("output_hc", cfg, False),
    ]
    if cfg.ple_layers:
        specs.append(Spec("per_layer_token_embd.weight", ((cfg.ple_row, cfg.ple_table_rows),)))
    return specs


def all_specs(cfg: ModelConfig) -> list[Spec]:
    return global_specs(cfg) + [s for il in range(cfg.n_layer) for s in layer_specs(cfg, il)]
