"""Tiny random Qwen4-Exp checkpoints and their transformers logits: the oracle every parity test uses.

Every parameter is randomized (norm gammas, A_log, dt_bias, conv taps, the PLE table included), scaled so
activations stay O(1) and every path matters to the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

torch = __import__("pytest").importorskip("torch", reason="the transformers oracle needs torch (pip install -e '.[test]')")
transformers = __import__("pytest").importorskip("transformers")


@dataclass
class TinySpec:
    name: str
    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    rotary: float = 0.25
    k_heads: int = 2
    v_heads: int = 6
    lin_dim: int = 16
    experts: int = 8
    top_k: int = 3
    ff: int = 24
    ff_shared: int = 32
    hc: int = 4
    rank: int = 12
    idx_heads: int = 4
    idx_dim: int = 16
    budget: int = 8
    ratio: int = 4
    vocab: int = 512
    eos: int = 300
    ple_layer: int | None = 2          # 1-based as transformers counts
    heads_per_ngram: int = 2
    ngram_base: int = 101
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def hf_config(self):
        from transformers import Qwen4ExpTextConfig
        return Qwen4ExpTextConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
            linear_num_key_heads=self.k_heads, linear_num_value_heads=self.v_heads,
            linear_key_head_dim=self.lin_dim, linear_value_head_dim=self.lin_dim,
            moe_intermediate_size=self.ff, shared_expert_intermediate_size=self.ff_shared,
            num_experts=self.experts, num_experts_per_tok=self.top_k, hc_count=self.hc, hc_lowrank=self.rank,
            ple_layer_ids=[self.ple_layer] if self.ple_layer else None, ngram_vocab_size_base=self.ngram_base,
            heads_per_ngram=self.heads_per_ngram, ngram_size=3, indexer_n_heads=self.idx_heads, indexer_kv_heads=1,
            indexer_head_dim=self.idx_dim, indexer_budget=self.budget, indexer_compress_ratio=self.ratio,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": self.rotary,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True},
            eos_token_id=self.eos, output_gate_type="sigmoid", split_ngram_parts=2, rms_norm_eps=1e-6,
            attn_implementation="eager", **self.extra)


SPECS = {
    # 3 value heads per key head, like the real model (48 / 16)
    "grouped": TinySpec("grouped"),
    # as many value heads as key heads (no retiling), wider hc rank, another rotary fraction
    "square": TinySpec("square", hidden=48, layers=4, heads=6, kv_heads=3, head_dim=16, rotary=0.5, k_heads=3,
                       v_heads=3, lin_dim=16, experts=6, top_k=2, ff=20, ff_shared=24, hc=3, rank=10, idx_heads=4,
                       idx_dim=16, budget=8, ratio=4, vocab=384, eos=310, ple_layer=1, seed=1),
    # two attention layers, a 2-token compress ratio, PLE on layer 3
    "deep": TinySpec("deep", hidden=32, layers=8, heads=2, kv_heads=1, head_dim=32, rotary=0.25, k_heads=2,
                     v_heads=4, lin_dim=8, experts=5, top_k=2, ff=16, ff_shared=16, hc=2, rank=6, idx_heads=4,
                     idx_dim=8, budget=6, ratio=2, vocab=320, eos=290, ple_layer=3, seed=2),
}


def randomize(model, seed: int) -> None:
    """Overwrite every parameter and the PLE table with seeded random values at O(1)-preserving scales."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1 or name.endswith("conv1d.weight"):
                if name.endswith("A_log"):
                    p.copy_(torch.empty(p.shape).uniform_(0.01, 4, generator=g).log())
                elif name.endswith("dt_bias"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
                elif name.endswith("conv1d.weight"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
                elif name.endswith("linear_attn.norm.weight"):
                    p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)
                else:                                  # zero-centred gammas: (1 + w)
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif "ngram_embedding" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))


def build(spec: TinySpec, folder: Path):
    """Save a randomized checkpoint to `folder`; returns the torch model (eval mode)."""
    from transformers import Qwen4ExpForCausalLM
    torch.manual_seed(spec.seed)
    model = Qwen4ExpForCausalLM(spec.hf_config()).eval()
    randomize(model, spec.seed + 1000)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return model


def hf_logits(model, tokens: list[int]) -> np.ndarray:
    """Teacher-forced logits (n_tokens, vocab) of the whole sequence in one forward, no cache."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=False)
    return out.logits[0].float().numpy()


def sequence(spec: TinySpec, n: int, seed: int = 0) -> list[int]:
    """n random tokens with EOS at a few places mid-sequence (including back to back)."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, spec.vocab, n).tolist()
    for i in (n // 5, n // 2, n // 2 + 1, (3 * n) // 4):
        toks[i] = spec.eos
    return toks


def rel_err(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per position: max |a - b| / max |b|."""
    return np.abs(a - b).max(axis=-1) / np.abs(b).max(axis=-1)
