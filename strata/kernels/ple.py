"""ple.cu's wrapper: the PLE block's gate, norm and dilated conv into the residual streams."""

from __future__ import annotations

import numpy as np

from strata.config import ModelConfig
from strata.cuda.arena import DevArray
from strata.cuda.launch import F, I, Launch, P, need


def ple_mix_launch(fn, name: str, cfg: ModelConfig, R: DevArray, key_raw: DevArray, value: DevArray,
                   norm_key: DevArray, norm_query: DevArray, norm_conv: DevArray, conv_w: DevArray, hist: DevArray,
                   step: DevArray, rows: int = 1) -> Launch:
    """The PLE block for the step's rows (up to `rows`), in order inside each stream's CTA."""
    C = cfg.hc_dim
    for a, what in ((R, "R"), (key_raw, "key")):
        need(a, f"{name} {what}", rows * C)
    for a, what in ((norm_key, "norm_key"), (norm_query, "norm_query"), (norm_conv, "norm_conv")):
        need(a, f"{name} {what}", C)
    need(value, name + " value", rows * cfg.n_embd)
    need(conv_w, name + " conv1d", C * cfg.ple_conv)
    need(hist, name + " history", cfg.ple_hist * C)
    need(step, name + " step", 8, np.int32)
    return Launch(fn, name, (cfg.hc,), (1024,), 0,
                  [P(R), P(key_raw), P(value), P(norm_key), P(norm_query), P(norm_conv), P(conv_w), P(hist), P(step),
                   I(cfg.n_embd), I(cfg.hc), I(cfg.ple_conv), I(cfg.ple_ngram), F(cfg.rms_eps)])
