"""`cli.py quantize`: an existing GGUF rewritten in a mix's types, streamed, metadata unchanged.

Against make-model: make-model draws float-typed tensors from the same per-tensor generators whatever the mix,
so quantizing its F32 file to the bf16 mix gives exactly its bf16 file. For the quantized types of `realistic`
it writes random valid blocks instead of quantizing floats (quantizing 125B random floats would take hours),
so quantizing its F32 file to `realistic` gives the same types with different values: those files' logits
legitimately differ, and the test compares with the F32 file's instead.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from strata.engine import Engine
from strata.model.gguf_file import GGUFFile
from strata.model.gguf_writer import GGUFStreamWriter
from strata.model.quantize_file import quantize_gguf
from strata.model.synth import make_model
from strata.quant import QType, dequantize, quantize

CLI = Path(__file__).parent.parent / "cli.py"
TOKENS = [1, 17, 300, 42, 500, 7, 7, 260, 99, 3, 500, 12]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def _make(path: Path, preset: str, mix: str, seed: int = 3) -> Path:
    make_model(preset, path, seed=seed, mix=mix, log=lambda s: None)
    return path


def _with_template(src: Path, dst: Path) -> Path:
    """A copy of a GGUF with a chat template added to its metadata."""
    gf = GGUFFile(src)
    w = GGUFStreamWriter(dst)
    for k, v in gf.metadata.items():
        w.add(k, *gf.value_types[k][:1], v, gf.value_types[k][1])
    w.add("tokenizer.chat_template", VT.STRING, TEMPLATE)
    for name, t in gf.tensors.items():
        w.add_tensor(name, t.shape, t.qtype, np.asarray(t.data))
    w.write()
    return dst


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CLI), *map(str, args)], capture_output=True, text=True, timeout=300)


def _logits(path: Path) -> np.ndarray:
    return Engine.open_sync(path).logits(TOKENS)


def test_bf16_mix_of_the_f32_model_is_make_models_bf16_model(tmp_path):
    f32 = _make(tmp_path / "f32.gguf", "tiny", "f32")
    bf16 = _make(tmp_path / "bf16.gguf", "tiny", "bf16")
    quantize_gguf(f32, tmp_path / "q.gguf", "bf16", log=lambda s: None)
    q, want = GGUFFile(tmp_path / "q.gguf"), GGUFFile(bf16)
    assert list(q.tensors) == list(want.tensors)
    for name, t in q.tensors.items():
        w = want.tensors[name]
        assert (t.qtype, t.shape) == (w.qtype, w.shape), name
        assert bytes(t.data) == bytes(w.data), name
    assert {t.qtype for t in q.tensors.values()} == {QType.BF16, QType.F32}
    assert np.array_equal(_logits(tmp_path / "q.gguf"), _logits(bf16))


def test_realistic_mix_has_make_models_types(tmp_path):
    f32 = _make(tmp_path / "f32.gguf", "small", "f32")
    real = _make(tmp_path / "real.gguf", "small", "realistic")
    quantize_gguf(f32, tmp_path / "q.gguf", "realistic", log=lambda s: None)
    q, want = GGUFFile(tmp_path / "q.gguf"), GGUFFile(real)
    assert {n: (t.qtype, t.shape) for n, t in q.tensors.items()} == \
        {n: (t.qtype, t.shape) for n, t in want.tensors.items()}
    assert {t.qtype for t in q.tensors.values()} >= {QType.Q2_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS,
                                                      QType.IQ4_NL, QType.Q8_0, QType.BF16}
    # the same weights quantized (2-bit experts): near the F32 model's logits (cosine 0.68-0.91 per position
    # measured), where make-model's realistic model, other values, is unrelated to them (|cosine| < 0.03)
    a, ref = _logits(tmp_path / "q.gguf"), _logits(f32)
    cos = (a * ref).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(ref, axis=-1)
    other = _logits(real)
    cos_other = (other * ref).sum(-1) / np.linalg.norm(other, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert cos.min() > 0.6 and np.abs(cos_other).max() < 0.2, (cos, cos_other)


def test_same_mix_copies_bytes_and_metadata(tmp_path):
    """A made model already in the mix is copied byte for byte; any metadata (a chat template) rides along."""
    real = _make(tmp_path / "real.gguf", "small", "realistic")
    src = _with_template(real, tmp_path / "src.gguf")
    r = _cli("quantize", src, tmp_path / "q.gguf", "--mix", "realistic", "--threads", 2)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "q.gguf").read_bytes() == src.read_bytes()
    assert GGUFFile(tmp_path / "q.gguf").metadata["tokenizer.chat_template"] == TEMPLATE
    assert "0 retyped" in r.stdout
    assert np.array_equal(_logits(tmp_path / "q.gguf"), _logits(real))


def test_metadata_is_unchanged_when_types_change(tmp_path):
    f32 = _make(tmp_path / "f32.gguf", "tiny", "f32")
    src = _with_template(f32, tmp_path / "src.gguf")
    quantize_gguf(src, tmp_path / "q.gguf", "q8_0", log=lambda s: None)
    a, b = GGUFFile(src), GGUFFile(tmp_path / "q.gguf")
    assert list(a.metadata.items()) == list(b.metadata.items()) and a.value_types == b.value_types
    assert b.metadata["tokenizer.chat_template"] == TEMPLATE
    want = GGUFFile(_make(tmp_path / "q8.gguf", "tiny", "q8_0"))
    assert {n: t.qtype for n, t in b.tensors.items()} == {n: t.qtype for n, t in want.tensors.items()}
    assert QType.Q8_0 in {t.qtype for t in b.tensors.values()}


def test_progress_lines_off_a_terminal(tmp_path):
    f32 = _make(tmp_path / "f32.gguf", "small", "f32")
    r = _cli("quantize", f32, tmp_path / "q.gguf", "--mix", "q8_0")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("quantize ")]
    assert "\r" not in r.stderr and 20 <= len(lines) <= 101
    got = [tuple(map(float, re.fullmatch(r"quantize (\d+\.\d)/(\d+\.\d) MiB", x).groups())) for x in lines]
    assert [d for d, _ in got] == sorted(d for d, _ in got)
    q = GGUFFile(tmp_path / "q.gguf")
    assert got[-1][0] == got[-1][1] == round((q.size - q.data_offset) / 2**20, 1)      # the tensor data


@pytest.mark.parametrize("case", ["missing", "not gguf", "unknown mix", "same file", "no folder"])
def test_bad_input_is_one_error_line(tmp_path, tiny_gguf, case):
    (tmp_path / "notes.txt").write_text("not a model\n" * 10)
    args = {"missing": (tmp_path / "nope.gguf", tmp_path / "q.gguf"),
            "not gguf": (tmp_path / "notes.txt", tmp_path / "q.gguf"),
            "unknown mix": (tiny_gguf, tmp_path / "q.gguf", "--mix", "q3_fancy"),
            "same file": (tiny_gguf, tiny_gguf),
            "no folder": (tiny_gguf, tmp_path / "no" / "q.gguf")}[case]
    want = {"missing": "no such file", "not gguf": "not a GGUF file", "unknown mix": "unknown mix 'q3_fancy'",
            "same file": "is the input file", "no folder": "does not exist"}[case]
    r = _cli("quantize", *args)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and want in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "q.gguf").exists() and not list(tmp_path.glob("*.partial"))


def test_q5_k_bytes_equal_ggml():
    """The realistic mix's shared experts are Q5_K: its quantizer is ggml's quantize_row_q5_K_ref, byte for byte
    (llama-cpp-python's libggml-base is the reference where installed)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (its libggml-base) is the reference")
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 1024)).astype(np.float32)
    x[0, :256] = 0
    x[1, :256] *= 1e-6
    x[2, 7] = 50
    x[3, :32] = np.arange(32) * 0.5 - 8
    want = np.zeros(x.size // 256 * 176, np.uint8)
    lib.quantize_row_q5_K_ref(x.ctypes.data_as(ctypes.c_void_p), want.ctypes.data_as(ctypes.c_void_p),
                              ctypes.c_int64(x.size))
    got = quantize(x, QType.Q5_K)
    assert got.shape == (16, 4 * 176) and np.array_equal(got.reshape(-1), want)
    y = dequantize(got, QType.Q5_K)
    assert np.sqrt(np.mean((y[4:] - x[4:]) ** 2) / np.mean(x[4:] ** 2)) < 0.04      # 5-bit: ~0.035
