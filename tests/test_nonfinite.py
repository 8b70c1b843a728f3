"""Non-finite values (issue 15): a forward that makes a NaN or inf logit is an error naming the first layer and stage
where a non-finite value appeared, never NaN output with exit 0; `inspect --check-weights` names the tensor."""

from __future__ import annotations

import struct

import numpy as np
import pytest

import cli
from strata.diagnose import NonFinite, first_nonfinite
from strata.model.loader import load_model
from strata.model.synth import make_model
from strata.reference.model import StageDump
from tools.fuzz_gguf import Gguf


def with_nan(src, dst, tensor: str, element: int, value: float = float("nan")):
    """A copy of src with one F32 element of `tensor` (flat, ggml order) set to value."""
    g = Gguf.read(src)
    t = next(t for t in g.infos if t.name == tensor.encode())
    at = t.offset + 4 * element
    g.data[at:at + 4] = struct.pack("<f", value)
    dst.write_bytes(g.to_bytes())
    return dst


@pytest.mark.parametrize("tensor, element, tokens, where", [
    # ssm_out projects the GDN output: the mixer stage of layer 2 is the first to hold the NaN
    ("blk.2.ssm_out.weight", 0, [1, 2, 3], NonFinite(0, 2, "mixer")),
    # token 7's embedding row (E = 64 values a row): first fed at position 2
    ("token_embd.weight", 7 * 64 + 5, [1, 2, 7, 3], NonFinite(2, -1, "embed")),
    # one LM head row: only the logits hold it, from position 0
    ("output.weight", 9 * 64, [4, 5], NonFinite(0, -1, "logits")),
    # the shared expert's down projection: the combine of layer 0
    ("blk.0.ffn_down_shexp.weight", 3, [1, 2], NonFinite(0, 0, "combine")),
])
def test_first_nonfinite_names_the_stage(tiny_gguf, tmp_path, tensor, element, tokens, where):
    m = load_model(with_nan(tiny_gguf, tmp_path / "n.gguf", tensor, element))
    assert first_nonfinite(m, tokens) == where
    # the oracle: the full dump's first non-finite key in forward order
    from strata.reference.model import RefModel, stage_order
    dump = StageDump()
    ref = RefModel(m.weights)
    with np.errstate(all="ignore"):
        ref.chunk(ref.new_state(dump), tokens)
    bad = sorted((k for k, v in dump.data.items() if not np.isfinite(v).all()), key=stage_order)
    assert NonFinite(*bad[0]) == where


def test_finite_model_has_no_first_nonfinite(tiny_gguf):
    assert first_nonfinite(load_model(tiny_gguf), [1, 2, 3, 500, 9]) is None


def test_cli_logits_nonfinite_is_one_error(tiny_gguf, tmp_path, capsys):
    p = with_nan(tiny_gguf, tmp_path / "n.gguf", "blk.2.ssm_out.weight", 0, float("inf"))
    out = tmp_path / "l.npy"
    assert cli.main(["logits", str(p), "--tokens", "1,2,3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the logits at position 0 are not finite")
    assert "the first non-finite value is at layer 2 (blk.2.*), stage 'mixer', at position 0" in err
    assert not out.exists()                       # no NaN output left behind


def test_cli_logits_writes_exactly_the_paths_given(tiny_gguf, tmp_path, capsys):
    out, dump = tmp_path / "logits.bin", tmp_path / "stages"
    assert cli.main(["logits", str(tiny_gguf), "--tokens", "1,2,3", "--out", str(out), "--dump", str(dump)]) == 0
    assert f"wrote {out}:" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits.bin", "stages"]
    from strata.engine import Engine
    assert np.array_equal(np.load(out), Engine.open_sync(tiny_gguf).logits([1, 2, 3]))
    assert (0, 1, "mixer") in StageDump.load(dump).data


def test_inspect_check_weights(tiny_gguf, tmp_path, capsys):
    assert cli.main(["inspect", str(tiny_gguf), "--check-weights"]) == 0
    assert "every value of the 113 tensors is finite" in capsys.readouterr().out
    p = with_nan(tiny_gguf, tmp_path / "n.gguf", "blk.2.ssm_out.weight", 100)   # numpy (64, 96): row 1, col 4
    assert cli.main(["inspect", str(p), "--check-weights"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "tensor 'blk.2.ssm_out.weight' (F32) holds a non-finite value (NaN or inf) at element 100 (numpy " \
           "index [1, 4])" in err


def test_check_weights_quantized_block_scale(tmp_path, capsys):
    """A Q8_0 block whose f16 scale is NaN: every value of the block is NaN, the first at the block's start."""
    src = tmp_path / "q8.gguf"
    make_model("tiny", src, mix="q8_0", log=lambda s: None)
    g = Gguf.read(src)
    t = next(t for t in g.infos if t.name == b"blk.1.attn_qkv.weight")
    g.data[t.offset + 3 * 34:t.offset + 3 * 34 + 2] = struct.pack("<e", float("nan"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(g.to_bytes())
    assert cli.main(["inspect", str(bad), "--check-weights"]) == 2
    assert "tensor 'blk.1.attn_qkv.weight' (Q8_0) holds a non-finite value (NaN or inf) at element 96" in \
        capsys.readouterr().err


@pytest.mark.asyncio
async def test_generate_names_where_nan_came_from(tiny_gguf, tmp_path):
    """A request whose logits turn non-finite ends with an error naming the first layer and stage that held a NaN
    (the reference fed what the request was fed); a request beside it on a finite path is not affected."""
    from strata.engine import Engine, EngineError
    from strata.sampling import SamplingParams
    path = with_nan(tiny_gguf, tmp_path / "n.gguf", "blk.2.ssm_out.weight", 0)
    async with await Engine.open(path) as e:
        with pytest.raises(EngineError, match=r"non-finite.*first non-finite value: layer 2 \(blk\.2\.\*\), "
                                              r"stage 'mixer', at position 0"):
            async for _ in e.generate([1, 2, 3], SamplingParams(max_tokens=2)):
                pass
        await e.scheduler.idle()
        assert e.scheduler.live == 0 and e.backend.live == 0


def test_prompt_that_is_not_text(tiny_gguf):
    """Bytes that were not UTF-8 (argv or JSON with lone surrogates) are refused with the position."""
    from strata.engine import Engine
    eng = Engine.open_sync(tiny_gguf)
    try:
        with pytest.raises(ValueError, match=r"not valid text: character 3"):
            eng.prompt_ids("abc\udcff")
    finally:
        eng.close()
