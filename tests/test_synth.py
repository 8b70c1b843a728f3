"""make-model: the presets' geometry (the flash preset is the real model's), bounded-memory streaming, types."""

import numpy as np

from strata.model.gguf_file import GGUFFile
from strata.model.synth import CHUNK_BYTES, PRESETS, _geometry, plan, tensor_chunks
from strata.quant import QType, dequantize, row_bytes


def test_flash_plan_is_the_real_geometry():
    cfg = _geometry(**PRESETS["flash"])
    p = {x.name: x for x in plan(cfg, "realistic")}
    n_params = sum(int(np.prod(x.shape)) for x in p.values())
    experts = sum(int(np.prod(x.shape)) for n, x in p.items() if "_exps" in n)
    assert cfg.n_layer == 48 and sum(cfg.recurrent) == 36 and cfg.n_vocab == 248320
    assert abs(experts - 120.8e9) < 0.1e9                       # MODEL.md: 120.8e9 expert parameters
    embd = 2560 * 248320                                        # read one row per token, not whole
    assert abs(n_params - experts - cfg.ple_table_rows * 160 - embd - 4.31e9) < 0.05e9  # 4.31e9 dense read
    one_expert = sum(row_bytes(p[f"blk.0.ffn_{k}_exps.weight"].qtype, p[f"blk.0.ffn_{k}_exps.weight"].shape[0])
                     * p[f"blk.0.ffn_{k}_exps.weight"].shape[1] for k in ("gate", "up", "down"))
    assert one_expert == 1_382_400                              # the seed's Q2_0 blob
    assert p["per_layer_token_embd.weight"].qtype == QType.IQ4_NL
    assert row_bytes(QType.IQ4_NL, 160) == 90                   # 90-byte PLE rows
    assert p["blk.0.ffn_gate_inp.weight"].qtype == QType.BF16 and p["blk.0.ssm_alpha.weight"].qtype == QType.BF16


def test_streaming_chunks_are_bounded_and_deterministic():
    cfg = _geometry(**PRESETS["flash"])
    x = next(q for q in plan(cfg, "realistic") if q.name == "blk.0.ffn_down_exps.weight")
    gen = tensor_chunks(x, seed=5, pool=None)()
    first, second = next(gen), next(gen)
    assert first.nbytes <= CHUNK_BYTES and first.nbytes % row_bytes(x.qtype, x.shape[0] * x.shape[1]) == 0
    again = next(tensor_chunks(x, seed=5, pool=None)())
    assert np.array_equal(first, again) and not np.array_equal(first[:1000], second[:1000])


def test_small_realistic_mix(tmp_path):
    from strata.model.synth import make_model
    make_model("small", tmp_path / "s.gguf", seed=1, log=lambda s: None)
    gf = GGUFFile(tmp_path / "s.gguf")
    types = {t.qtype for t in gf.tensors.values()}
    assert {QType.Q2_0, QType.Q4_K, QType.Q6_K, QType.IQ4_XS, QType.IQ4_NL, QType.BF16, QType.F32} <= types
    # random blocks decode to finite values of the intended scale
    w = gf.tensors["blk.0.ffn_gate_exps.weight"]
    v = dequantize(w.data, w.qtype)
    assert np.all(np.isfinite(v)) and 0.2 / 16 < v.std() < 5 / 16
    assert "strata make-model preset=small" in gf.metadata["strata.synthetic"]
