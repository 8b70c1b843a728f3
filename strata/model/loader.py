"""Open a GGUF model: parse, build ModelConfig, check every tensor, wrap the weights. Nothing is copied."""

from __future__ import annotations

import os
from dataclasses import dataclass

from strata.config import ConfigError, ModelConfig
from strata.model.gguf_file import GGUFError, GGUFFile
from strata.model.validate import check_metadata
from strata.model.weights import Weights, load_weights


@dataclass
class Model:
    file: GGUFFile
    cfg: ModelConfig
    weights: Weights

    @property
    def metadata(self) -> dict:
        return self.file.metadata


def _n_blocks(gf: GGUFFile) -> int:
    """1 + the highest N of the file's blk.N.* tensors (0 when it has none)."""
    ids = [n.split(".", 2)[1] for n in gf.tensors if n.startswith("blk.")]
    return max((int(i) + 1 for i in ids if i.isdigit()), default=0)


def load_model(path: str | os.PathLike, exact: bool = False) -> Model:
    """`exact`: quantized matvecs use f32 activations instead of llama.cpp's activation formats."""
    gf = GGUFFile(path)
    check_metadata(gf)
    emb = gf.tensor("token_embd.weight")
    if len(emb.shape) != 2:
        raise GGUFError(f"{gf.path}: tensor 'token_embd.weight' has ggml shape {list(emb.shape)}, expected [E, vocab]")
    try:
        cfg = ModelConfig.from_metadata(gf.metadata, n_vocab=emb.shape[1], n_blocks=_n_blocks(gf))
    except ConfigError as e:
        raise GGUFError(f"{gf.path}: {e}") from None
    return Model(gf, cfg, load_weights(gf, cfg, exact=exact))
