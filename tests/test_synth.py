"""make-model: the presets' geometry (the flash preset is the real model's), bounded-memory streaming, types; the
default model runs in llama.cpp."""

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from strata.config import ConfigError
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


def test_rope_sections_fit_every_preset():
    # MRoPE sections count rotary pairs: every preset's fill its n_rot / 2 pairs in the real model's proportions
    for name, kw in PRESETS.items():
        cfg = _geometry(**kw)
        assert sum(cfg.rope_sections) == cfg.n_rot // 2, name
        assert all(s > 0 for s in cfg.rope_sections[:3]) and cfg.rope_sections[3] == 0, name
        cfg.validate()
    assert _geometry(**PRESETS["flash"]).rope_sections == (11, 11, 10, 0)    # Qwen3.8-Flash-Next's own
    assert _geometry(**PRESETS["tiny"]).rope_sections == (2, 1, 1, 0)


def test_config_refuses_sections_past_the_rotary_pairs():
    cfg = _geometry(**PRESETS["tiny"])                                     # n_rot 8: 4 rotary pairs
    replace(cfg, rope_sections=(4, 0, 0, 0)).validate()
    with pytest.raises(ConfigError, match=r"key 'qwen4exp\.rope\.dimension_sections' = \[11, 11, 10, 0\] sums to "
                                          r"32 rotary pairs, past rope\.dimension_count / 2 = 4"):
        replace(cfg, rope_sections=(11, 11, 10, 0)).validate()


_LLAMA_SCRIPT = """
import sys
import numpy as np
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, logits_all=True, verbose=False)
tokens = [int(t) for t in sys.argv[2].split(",")]
llm.eval(tokens)
np.save(sys.argv[3], np.array(llm.scores[:len(tokens)], dtype=np.float32))
"""


def llamacpp_logits(path, tokens: list[int], tmp_path) -> np.ndarray:
    """llama-cpp-python's logits (n_tokens, n_vocab) of a GGUF, from a child process: ggml refuses a bad file with
    an abort, which must fail the test, not end the run. Skips when llama_cpp is not importable."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:                                      # not installed, or its library does not load
        pytest.skip(f"llama_cpp is not importable: {e}")
    out = tmp_path / "llama.npy"
    r = subprocess.run([sys.executable, "-c", _LLAMA_SCRIPT, str(path), ",".join(map(str, tokens)), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return np.load(out)


def assert_close_to_strata(path, text: str, tmp_path) -> None:
    """llama.cpp's logits of `text` (at most 12 tokens: within tiny's QSA budget, where llama.cpp is exact) match
    strata's to 1e-3 of each row's largest, with the same argmax."""
    from strata.engine import Engine
    eng = Engine.open_sync(path)
    tokens = eng.tokenizer.encode(text)[:12]
    got, want = llamacpp_logits(path, tokens, tmp_path), eng.logits(tokens)
    assert got.shape == want.shape == (len(tokens), eng.cfg.n_vocab)
    err = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    assert err.max() < 1e-3 and np.array_equal(got.argmax(1), want.argmax(1)), err


def test_llamacpp_runs_the_default_model(tmp_path):
    from strata.default_model import default_model_path
    assert_close_to_strata(default_model_path(log=lambda s: None), "The keeper walked out to the light", tmp_path)
