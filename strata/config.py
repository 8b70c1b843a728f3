"""ModelConfig: the qwen4exp geometry, built once from GGUF metadata and validated with errors that name the key."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

from gguf import GGUFValueType as VT

ARCH = "qwen4exp"
# The only compress ratio Qwen3.8-Flash-Next uses; stands in when a file's ratios were lost (see from_metadata).
DEFAULT_COMPRESS_RATIO = 4
# Every QSA query's cell list is top_k long (2048 in Qwen3.8-Flash-Next); more than this is not a sparse budget.
MAX_INDEXER_TOP_K = 1 << 16


class ConfigError(ValueError):
    """Metadata that does not describe a model strata can run; the message names the key."""


@dataclass(frozen=True)
class ModelConfig:
    # core
    n_layer: int                    # block_count
    n_embd: int                     # embedding_length (E)
    n_vocab: int                    # rows of token_embd
    n_ctx_train: int                # context_length
    rms_eps: float                  # attention.layer_norm_rms_epsilon
    # QSA attention
    n_head: int                     # attention.head_count (H)
    n_head_kv: int                  # attention.head_count_kv (Hkv)
    head_dim: int                   # attention.key_length (D)
    n_rot: int                      # rope.dimension_count: rotated dims of each head
    rope_base: float                # rope.freq_base
    idx_heads: int                  # attention.indexer.head_count (Hi)
    idx_dim: int                    # attention.indexer.key_length (Di)
    idx_budget: int                 # attention.indexer.top_k: tokens selected from complete blocks
    compress_ratios: tuple[int, ...]  # per layer; 0 on GDN layers
    # GDN
    ssm_conv: int                   # ssm.conv_kernel (K)
    ssm_state: int                  # ssm.state_size: head dim of k and v (Dk = Dv)
    ssm_k_heads: int                # ssm.group_count (Hk)
    ssm_v_heads: int                # ssm.time_step_rank (Hv)
    recurrent: tuple[bool, ...]     # per layer: GDN (True) or QSA (False)
    # hyper-connections
    hc: int                         # hyper_connection.count
    hc_rank: int                    # hyper_connection.low_rank
    # MoE
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    # PLE (empty ple_layers: no PLE)
    ple_layers: tuple[int, ...] = ()
    ple_ngram: int = 0
    ple_heads_per_ngram: int = 0
    ple_conv: int = 0
    ple_eos: int = 0
    ple_row: int = 0                # embedding_length_per_layer_input: values per table row
    ple_multipliers: tuple[int, ...] = ()
    ple_offsets: tuple[int, ...] = ()
    ple_vocab_sizes: tuple[int, ...] = ()
    rope_sections: tuple[int, ...] = (0, 0, 0, 0)
    eos_id: int | None = None       # tokenizer.ggml.eos_token_id
    notes: tuple[str, ...] = field(default=(), compare=False)  # what from_metadata decided on the file's behalf

    # derived sizes -------------------------------------------------------------------------------------------
    @property
    def hc_dim(self) -> int:
        return self.hc * self.n_embd

    @property
    def key_dim(self) -> int:       # GDN q and k widths
        return self.ssm_k_heads * self.ssm_state

    @property
    def value_dim(self) -> int:     # GDN v width
        return self.ssm_v_heads * self.ssm_state

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def ple_heads(self) -> int:
        return (self.ple_ngram - 1) * self.ple_heads_per_ngram

    @property
    def ple_dim(self) -> int:       # the gathered vector: all heads' rows concatenated
        return self.ple_heads * self.ple_row

    @property
    def ple_hist(self) -> int:      # PLE conv state rows: (kernel - 1) * dilation, dilation = ngram size
        return (self.ple_conv - 1) * self.ple_ngram

    @property
    def ple_table_rows(self) -> int:
        return max(o + s for o, s in zip(self.ple_offsets, self.ple_vocab_sizes)) if self.ple_layers else 0

    def is_qsa(self, layer: int) -> bool:
        return not self.recurrent[layer]

    def block_topk(self, layer: int) -> int:
        return self.idx_budget // self.compress_ratios[layer]

    # metadata ------------------------------------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, meta: dict[str, Any], n_vocab: int | None = None,
                      n_blocks: int | None = None) -> "ModelConfig":
        """`n_blocks`: how many blk.N tensor groups the file holds; block_count may not exceed it (checked before
        anything is sized by block_count)."""
        arch = meta.get("general.architecture")
        if arch is None:
            raise ConfigError("missing key 'general.architecture'")
        if arch != ARCH:
            raise ConfigError(f"general.architecture is {_show(arch)}, strata runs '{ARCH}' (Qwen3.8-Flash-Next) "
                              f"only")
        p = ARCH + "."

        def get(key: str, kind: Any = int, default: Any = ...) -> Any:
            """The value of key p + key, checked to be of `kind` (see _of_kind)."""
            k = p + key
            if k not in meta:
                if default is ...:
                    raise ConfigError(f"missing key '{k}'")
                return default
            return _of_kind(k, meta[k], kind)

        def positive(key: str, v: int) -> int:
            if v <= 0:
                raise ConfigError(f"key '{p + key}' = {v} must be > 0")
            return v

        n_layer = positive("block_count", get("block_count"))
        if n_blocks is not None and n_layer > n_blocks:
            held = f"blocks blk.0 .. blk.{n_blocks - 1} only" if n_blocks else "no blk.N tensors"
            raise ConfigError(f"key '{p}block_count' = {n_layer}, but the file holds {held}")
        notes: list[str] = []

        def per_layer(key: str, v: Any) -> list:
            if isinstance(v, list):
                if len(v) != n_layer:
                    raise ConfigError(f"key '{p + key}' has {len(v)} entries, block_count is {n_layer}")
                return v
            return [v] * n_layer

        if p + "attention.recurrent_layers" in meta:
            recurrent = [bool(x) for x in per_layer("attention.recurrent_layers",
                                                   get("attention.recurrent_layers", "[bool]"))]
        else:
            interval = positive("full_attention_interval", get("full_attention_interval", int, 4))
            recurrent = [(i + 1) % interval != 0 for i in range(n_layer)]

        ratios = list(per_layer("attention.compress_ratios", get("attention.compress_ratios", "per-layer", 0)))
        lost = [i for i in range(n_layer) if not recurrent[i] and ratios[i] == 0]
        if lost:
            # llama.cpp's converter under a recent transformers sees "indexed_attention" where it tests for
            # "full_attention" and writes 0 for every layer; the checkpoint's QSA layers still hold indexer weights.
            for i in lost:
                ratios[i] = DEFAULT_COMPRESS_RATIO
            notes.append(f"{p}attention.compress_ratios is 0 on attention layers {lost}: the file was written by a "
                         f"converter that lost them; using ratio {DEFAULT_COMPRESS_RATIO} (Qwen3.8-Flash-Next's)")
        for i in range(n_layer):
            if recurrent[i]:
                ratios[i] = 0
            elif ratios[i] < 0:
                raise ConfigError(f"key '{p}attention.compress_ratios'[{i}] = {ratios[i]} must be > 0")

        head_dim = positive("attention.key_length", get("attention.key_length"))
        vlen = get("attention.value_length", int, head_dim)
        if vlen != head_dim:
            raise ConfigError(f"key '{p}attention.value_length' = {vlen} differs from key_length {head_dim}")
        hkv = get("attention.head_count_kv", "per-layer")
        if isinstance(hkv, list):
            hkv = per_layer("attention.head_count_kv", hkv)
            attn_kv = {hkv[i] for i in range(n_layer) if not recurrent[i]}
            if len(attn_kv) > 1:
                raise ConfigError(f"key '{p}attention.head_count_kv' varies across attention layers: {hkv}")
            hkv = attn_kv.pop() if attn_kv else max(hkv)

        ple_layers = tuple(get("ple.layers", "[int]", []))
        ple: dict[str, Any] = {}
        if ple_layers:
            if len(ple_layers) != 1:
                raise ConfigError(f"key '{p}ple.layers' = {list(ple_layers)}: one PLE layer is supported")
            ple = dict(
                ple_ngram=get("ple.ngram_size"), ple_heads_per_ngram=get("ple.heads_per_ngram"),
                ple_conv=get("ple.conv_kernel"), ple_eos=get("ple.eos_token_id"),
                ple_row=get("embedding_length_per_layer_input"),
                ple_multipliers=tuple(get("ple.layer_multipliers", "[int]")),
                ple_offsets=tuple(get("ple.head_offsets", "[int]")),
                ple_vocab_sizes=tuple(get("ple.head_vocab_sizes", "[int]")),
            )

        eos_key = "tokenizer.ggml.eos_token_id"
        eos_id = _of_kind(eos_key, meta[eos_key], int) if eos_key in meta else None
        cfg = cls(
            n_layer=n_layer,
            n_embd=positive("embedding_length", get("embedding_length")),
            n_vocab=n_vocab if n_vocab is not None else len(meta.get("tokenizer.ggml.tokens", [])),
            n_ctx_train=get("context_length", int, 0),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", float)),
            n_head=positive("attention.head_count", get("attention.head_count")),
            n_head_kv=hkv, head_dim=head_dim,
            n_rot=get("rope.dimension_count", int, head_dim),
            rope_base=float(get("rope.freq_base", float, 10000.0)),
            idx_heads=positive("attention.indexer.head_count", get("attention.indexer.head_count")),
            idx_dim=positive("attention.indexer.key_length", get("attention.indexer.key_length")),
            idx_budget=positive("attention.indexer.top_k", get("attention.indexer.top_k")),
            compress_ratios=tuple(ratios),
            ssm_conv=positive("ssm.conv_kernel", get("ssm.conv_kernel")),
            ssm_state=positive("ssm.state_size", get("ssm.state_size")),
            ssm_k_heads=positive("ssm.group_count", get("ssm.group_count")),
            ssm_v_heads=positive("ssm.time_step_rank", get("ssm.time_step_rank")),
            recurrent=tuple(recurrent),
            hc=get("hyper_connection.count"), hc_rank=positive("hyper_connection.low_rank",
                                                                get("hyper_connection.low_rank")),
            n_expert=positive("expert_count", get("expert_count")),
            n_expert_used=positive("expert_used_count", get("expert_used_count")),
            n_ff_exp=positive("expert_feed_forward_length", get("expert_feed_forward_length")),
            n_ff_shexp=positive("expert_shared_feed_forward_length", get("expert_shared_feed_forward_length")),
            ple_layers=ple_layers,
            rope_sections=tuple(get("rope.dimension_sections", "[int]", [0, 0, 0, 0])),
            eos_id=eos_id,
            notes=tuple(notes),
            **ple,
        )
        cfg.validate()
        inner = get("ssm.inner_size", int, cfg.value_dim)
        if inner != cfg.value_dim:
            raise ConfigError(f"key '{p}ssm.inner_size' = {inner}, expected time_step_rank x state_size = "
                              f"{cfg.value_dim}")
        for n in notes:
            warnings.warn(n, stacklevel=2)
        return cfg

    def validate(self) -> None:
        """Every value in the range the forward is defined on (finite; positive where it divides, normalizes or
        counts), and every size that no tensor shape bounds (the indexer budget) capped."""
        p = ARCH + "."
        if self.hc <= 1:
            raise ConfigError(f"key '{p}hyper_connection.count' = {self.hc} must be > 1")
        if not math.isfinite(self.rms_eps) or not 0 < self.rms_eps < 1:
            raise ConfigError(f"key '{p}attention.layer_norm_rms_epsilon' = {self.rms_eps} must be in (0, 1)")
        if not math.isfinite(self.rope_base) or self.rope_base <= 1:
            raise ConfigError(f"key '{p}rope.freq_base' = {self.rope_base} must be a finite number > 1")
        if self.n_ctx_train < 0:
            raise ConfigError(f"key '{p}context_length' = {self.n_ctx_train} must be >= 0 (0: not given)")
        if self.n_head_kv <= 0:
            raise ConfigError(f"key '{p}attention.head_count_kv' = {self.n_head_kv} must be > 0")
        if self.n_head % self.n_head_kv:
            raise ConfigError(f"key '{p}attention.head_count' = {self.n_head} is not a multiple of "
                              f"head_count_kv = {self.n_head_kv}")
        if self.n_rot % 2 or not 0 < self.n_rot <= min(self.head_dim, self.idx_dim):
            raise ConfigError(f"key '{p}rope.dimension_count' = {self.n_rot} must be even and fit both the head "
                              f"({self.head_dim}) and the indexer head ({self.idx_dim})")
        if any(s < 0 for s in self.rope_sections):
            raise ConfigError(f"key '{p}rope.dimension_sections' = {list(self.rope_sections)} must be >= 0")
        if sum(self.rope_sections) > self.n_rot // 2:
            # MRoPE sections count rotary pairs; llama.cpp aborts on sections past a rotated head (the indexer's)
            raise ConfigError(f"key '{p}rope.dimension_sections' = {list(self.rope_sections)} sums to "
                              f"{sum(self.rope_sections)} rotary pairs, past rope.dimension_count / 2 = "
                              f"{self.n_rot // 2}")
        if self.ssm_v_heads % self.ssm_k_heads:
            raise ConfigError(f"key '{p}ssm.time_step_rank' = {self.ssm_v_heads} is not a multiple of "
                              f"ssm.group_count = {self.ssm_k_heads}")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise ConfigError(f"key '{p}expert_used_count' = {self.n_expert_used} must be in [1, {self.n_expert}]")
        if len(self.recurrent) != self.n_layer or len(self.compress_ratios) != self.n_layer:
            raise ConfigError(f"the per-layer keys of '{p}attention' have {len(self.recurrent)} and "
                              f"{len(self.compress_ratios)} entries, block_count is {self.n_layer}")
        if not 0 < self.idx_budget <= MAX_INDEXER_TOP_K:
            # every query's cell list is top_k long
            raise ConfigError(f"key '{p}attention.indexer.top_k' = {self.idx_budget} must be in "
                              f"[1, {MAX_INDEXER_TOP_K}] (Qwen3.8-Flash-Next uses 2048)")
        for il in range(self.n_layer):
            r = self.compress_ratios[il]
            if not self.recurrent[il] and (r <= 0 or self.idx_budget % r):
                raise ConfigError(f"key '{p}attention.compress_ratios'[{il}] = {r}: the compress ratio of an "
                                  f"attention layer must be > 0 and divide attention.indexer.top_k = "
                                  f"{self.idx_budget}")
        if self.n_vocab <= 0:
            raise ConfigError("the vocabulary is empty: no 'tokenizer.ggml.tokens' and no token_embd rows")
        if self.eos_id is not None and not 0 <= self.eos_id < self.n_vocab:
            raise ConfigError(f"key 'tokenizer.ggml.eos_token_id' = {self.eos_id} is not a token id in "
                              f"[0, {self.n_vocab})")
        if self.ple_layers:
            layer = self.ple_layers[0]
            if not 0 <= layer < self.n_layer or not self.recurrent[layer]:
                raise ConfigError(f"key '{p}ple.layers' = {list(self.ple_layers)}: the PLE layer must be a GDN layer "
                                  f"in [0, {self.n_layer})")
            if self.ple_ngram < 2 or self.ple_heads_per_ngram <= 0 or self.ple_conv <= 0 or self.ple_row <= 0:
                raise ConfigError(f"keys '{p}ple.*': ngram_size {self.ple_ngram}, heads_per_ngram "
                                  f"{self.ple_heads_per_ngram}, conv_kernel {self.ple_conv}, row {self.ple_row} "
                                  f"must all be positive (ngram_size >= 2)")
            if not 0 <= self.ple_eos < self.n_vocab:
                raise ConfigError(f"key '{p}ple.eos_token_id' = {self.ple_eos} is not a token id in "
                                  f"[0, {self.n_vocab})")
            if len(self.ple_multipliers) < self.ple_ngram:
                raise ConfigError(f"key '{p}ple.layer_multipliers' has {len(self.ple_multipliers)} entries, "
                                  f"ngram_size {self.ple_ngram} needs that many")
            if any(not 0 <= m < 1 << 64 for m in self.ple_multipliers):
                # the n-gram hash is uint64 arithmetic
                raise ConfigError(f"key '{p}ple.layer_multipliers' = {list(self.ple_multipliers)} must be uint64")
            for key, arr in (("ple.head_offsets", self.ple_offsets), ("ple.head_vocab_sizes", self.ple_vocab_sizes)):
                if len(arr) < self.ple_heads:
                    raise ConfigError(f"key '{p}{key}' has {len(arr)} entries, {self.ple_heads} heads need that many")
            if any(not 0 <= o < 1 << 63 for o in self.ple_offsets):
                raise ConfigError(f"key '{p}ple.head_offsets' = {list(self.ple_offsets)} must be >= 0 (row numbers)")
            if any(not 0 < s < 1 << 63 for s in self.ple_vocab_sizes):
                raise ConfigError(f"key '{p}ple.head_vocab_sizes' = {list(self.ple_vocab_sizes)} must be > 0")

    def to_metadata(self) -> list[tuple[str, VT, Any, VT | None]]:
        """(key, value type, value, array element type) for every architecture key, typed as llama.cpp reads them."""
        p = ARCH + "."
        u32 = VT.UINT32
        out: list[tuple[str, VT, Any, VT | None]] = [
            ("general.architecture", VT.STRING, ARCH, None),
            (p + "block_count", u32, self.n_layer, None),
            (p + "context_length", u32, self.n_ctx_train, None),
            (p + "embedding_length", u32, self.n_embd, None),
            (p + "attention.head_count", u32, self.n_head, None),
            (p + "attention.head_count_kv", u32, self.n_head_kv, None),
            (p + "attention.key_length", u32, self.head_dim, None),
            (p + "attention.value_length", u32, self.head_dim, None),
            (p + "attention.layer_norm_rms_epsilon", VT.FLOAT32, self.rms_eps, None),
            (p + "rope.dimension_count", u32, self.n_rot, None),
            (p + "rope.freq_base", VT.FLOAT32, self.rope_base, None),
            (p + "rope.dimension_sections", VT.ARRAY, list(self.rope_sections), VT.INT32),
            (p + "expert_count", u32, self.n_expert, None),
            (p + "expert_used_count", u32, self.n_expert_used, None),
            (p + "expert_feed_forward_length", u32, self.n_ff_exp, None),
            (p + "expert_shared_feed_forward_length", u32, self.n_ff_shexp, None),
            (p + "ssm.conv_kernel", u32, self.ssm_conv, None),
            (p + "ssm.state_size", u32, self.ssm_state, None),
            (p + "ssm.group_count", u32, self.ssm_k_heads, None),
            (p + "ssm.time_step_rank", u32, self.ssm_v_heads, None),
            (p + "ssm.inner_size", u32, self.value_dim, None),
            (p + "attention.recurrent_layers", VT.ARRAY, list(self.recurrent), VT.BOOL),
            (p + "full_attention_interval", u32, _interval(self.recurrent), None),
            (p + "hyper_connection.count", u32, self.hc, None),
            (p + "hyper_connection.low_rank", u32, self.hc_rank, None),
            (p + "attention.indexer.head_count", u32, self.idx_heads, None),
            (p + "attention.indexer.key_length", u32, self.idx_dim, None),
            (p + "attention.indexer.top_k", u32, self.idx_budget, None),
            (p + "attention.compress_ratios", VT.ARRAY, list(self.compress_ratios), VT.INT32),
        ]
        if self.ple_layers:
            out += [
                (p + "ple.layers", VT.ARRAY, list(self.ple_layers), VT.INT32),
                (p + "ple.ngram_size", u32, self.ple_ngram, None),
                (p + "ple.heads_per_ngram", u32, self.ple_heads_per_ngram, None),
                (p + "ple.conv_kernel", u32, self.ple_conv, None),
                (p + "ple.eos_token_id", u32, self.ple_eos, None),
                (p + "embedding_length_per_layer_input", u32, self.ple_row, None),
                (p + "ple.layer_multipliers", VT.ARRAY, list(self.ple_multipliers), VT.UINT64),
                (p + "ple.head_offsets", VT.ARRAY, list(self.ple_offsets), VT.UINT64),
                (p + "ple.head_vocab_sizes", VT.ARRAY, list(self.ple_vocab_sizes), VT.UINT64),
            ]
        return out

    def summary(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("notes",)}


def _interval(recurrent: tuple[bool, ...]) -> int:
    attn = [i for i, r in enumerate(recurrent) if not r]
    return attn[0] + 1 if attn else len(recurrent) + 1


def _show(v: Any) -> str:
    """A value for an error message: long arrays abbreviated."""
    if isinstance(v, list) and len(v) > 8:
        return f"[{', '.join(map(repr, v[:4]))}, ... ({len(v)} items)]"
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_ints(v: Any) -> bool:
    return isinstance(v, list) and all(map(_is_int, v))


# a value kind -> (its test, what the error says it should be)
_KINDS: dict[Any, tuple[Any, str]] = {
    int: (_is_int, "an integer"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "[int]": (_is_ints, "an array of integers"),
    "[bool]": (lambda v: isinstance(v, list) and all(isinstance(x, bool) or _is_int(x) and x in (0, 1) for x in v),
               "an array of booleans"),
    "per-layer": (lambda v: _is_int(v) or _is_ints(v), "an integer or an array of integers, one per layer"),
}


def _of_kind(key: str, v: Any, kind: Any) -> Any:
    """v if it is of `kind` (a key of _KINDS), else a ConfigError naming the key and what was expected. Arrays
    where a scalar belongs (and the reverse) are refused, as llama.cpp's loader refuses them; numbers must be
    finite."""
    ok, what = _KINDS[kind]
    if not ok(v):
        raise ConfigError(f"key '{key}' = {_show(v)} should be {what}")
    if kind is float and not math.isfinite(v):
        raise ConfigError(f"key '{key}' = {v} must be finite")
    return v
