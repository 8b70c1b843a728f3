"""ple.cu's wrappers: the PLE block's gate, norm and dilated conv into the residual streams."""

from __future__ import annotations

import numpy as np

from strata.config import ModelConfig
from strata.cuda.arena import DevArray
from strata.cuda.launch import F, I, Launch, P, need


def ple_launches(fn_of, name: str, cfg: ModelConfig, R: DevArray, key_raw: DevArray, value: DevArray,
                 gate: DevArray, norm_key: DevArray, norm_query: DevArray, norm_conv: DevArray, conv_w: DevArray,
                 hist: DevArray, step: DevArray, rows: int = 1) -> tuple[Launch, Launch, Launch]:
    """The PLE block for the step's rows (up to `rows`): ple_gate, ple_conv, ple_hist (ple.cu), each over every
    row at once; key_raw is overwritten (its rows' gn), gate (rows, hc) is scratch. fn_of(kernel name) -> the
    function."""
    C, hc, E, Hh = cfg.hc_dim, cfg.hc, cfg.n_embd, cfg.ple_hist
    for a, what in ((R, "R"), (key_raw, "key")):
        need(a, f"{name} {what}", rows * C)
    for a, what in ((norm_key, "norm_key"), (norm_query, "norm_query"), (norm_conv, "norm_conv")):
        need(a, f"{name} {what}", C)
    need(value, name + " value", rows * E)
    need(gate, name + " gate", rows * hc)
    need(conv_w, name + " conv1d", C * cfg.ple_conv)
    need(hist, name + " history", Hh * C)
    need(step, name + " step", 8, np.int32)
    nc = -(-C // 256)
    return (Launch(fn_of("ple_gate"), name + ".gate", (hc, rows), (256,), 0,
                   [P(R), P(key_raw), P(value), P(norm_key), P(norm_query), P(norm_conv), P(gate), P(step), I(E),
                    I(hc), F(cfg.rms_eps)]),
            Launch(fn_of("ple_conv"), name + ".conv", (nc, rows), (256,), 0,
                   [P(R), P(key_raw), P(value), P(gate), P(conv_w), P(hist), P(step), I(E), I(hc), I(cfg.ple_conv),
                    I(cfg.ple_ngram)]),
            Launch(fn_of("ple_hist"), name + ".hist", (nc, Hh), (256,), 0, [P(key_raw), P(hist), P(step), I(C), I(Hh)]))
