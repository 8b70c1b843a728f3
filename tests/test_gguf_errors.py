"""Bad files: one clear GGUFError naming the key or tensor, never a traceback from inside numpy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.model.gguf_file import GGUFError, GGUFFile
from strata.model.loader import load_model
from gguf_edit import rewrite
from strata.quant import QType

ROOT = Path(__file__).parent.parent


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"this is not a model file at all, just text" * 4)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(p)


def test_missing_and_directory(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        GGUFFile(tmp_path / "absent.gguf")
    with pytest.raises(GGUFError, match="directory"):
        GGUFFile(tmp_path)


@pytest.mark.parametrize("frac", [0.0005, 0.01, 0.2, 0.6, 0.999])
def test_truncated(tiny_gguf, tmp_path, frac):
    data = tiny_gguf.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:max(24, int(len(data) * frac))])
    with pytest.raises(GGUFError, match="truncated|too short"):
        load_model(p)


def test_wrong_architecture(tiny_gguf, tmp_path):
    from gguf import GGUFValueType as VT
    p = rewrite(tiny_gguf, tmp_path / "a.gguf", meta={"general.architecture": (VT.STRING, "llama", None)})
    with pytest.raises(GGUFError, match="general.architecture is 'llama'"):
        load_model(p)


def test_missing_key(tiny_gguf, tmp_path):
    p = rewrite(tiny_gguf, tmp_path / "k.gguf", drop_meta=("qwen4exp.ssm.state_size",))
    with pytest.raises(GGUFError, match="missing key 'qwen4exp.ssm.state_size'"):
        load_model(p)


def test_missing_tensor(tiny_gguf, tmp_path):
    p = rewrite(tiny_gguf, tmp_path / "t.gguf", drop_tensor="blk.2.ssm_out.weight")
    with pytest.raises(GGUFError, match="missing tensor 'blk.2.ssm_out.weight'"):
        load_model(p)


def test_wrong_shape(tiny_gguf, tmp_path):
    p = rewrite(tiny_gguf, tmp_path / "s.gguf", reshape=("blk.3.attn_q.weight", (256, 64)))
    with pytest.raises(GGUFError, match=r"tensor 'blk.3.attn_q.weight' has ggml shape \[256, 64\], "
                                        r"the metadata implies \[64, 256\]"):
        load_model(p)


def test_quantized_vector_refused(tiny_gguf, tmp_path):
    p = rewrite(tiny_gguf, tmp_path / "v.gguf", retype=("blk.3.attn_q_norm.weight", QType.Q8_0))
    with pytest.raises(GGUFError, match="attn_q_norm.weight' is Q8_0"):
        load_model(p)


def test_inconsistent_metadata(tiny_gguf, tmp_path):
    from gguf import GGUFValueType as VT
    p = rewrite(tiny_gguf, tmp_path / "m.gguf", meta={"qwen4exp.hyper_connection.count": (VT.UINT32, 1, None)})
    with pytest.raises(GGUFError, match="hyper_connection.count"):
        load_model(p)


def test_cli_reports_one_line(tiny_gguf, tmp_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny_gguf.read_bytes()[:5000])
    r = subprocess.run([sys.executable, str(ROOT / "cli.py"), "inspect", str(p)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and "truncated" in r.stderr and "Traceback" not in r.stderr
