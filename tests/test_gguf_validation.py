"""Load-time validation (issue 15): every file the engine used to accept and then compute NaN from, or whose metadata
llama.cpp refuses, or that raised a traceback, now fails at load with one GGUFError naming the key or tensor and
what was expected. Each file is the tiny model with one edit (tools/fuzz_gguf.py's editor)."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from strata.engine import Engine
from strata.model.gguf_file import GGUFError, GGUFFile
from strata.model.loader import load_model
from strata.quant import QType
from tools.fuzz_gguf import Gguf, Info


def edited(src, tmp_path, fn, name="e.gguf"):
    g = Gguf.read(src)
    fn(g)
    p = tmp_path / name
    p.write_bytes(g.to_bytes())
    return p


def fails(path, match):
    with pytest.raises(GGUFError, match=match):
        load_model(path)


def index(g: Gguf, name: str) -> int:
    return next(i for i, t in enumerate(g.infos) if t.name == name.encode())


# ---- the data layout ---------------------------------------------------------------------------------------------
def test_overlapping_offset(tiny_gguf, tmp_path):
    def overlap(g):
        i = index(g, "blk.1.ssm_out.weight")
        g.infos[i].offset = g.infos[i - 1].offset
    fails(edited(tiny_gguf, tmp_path, overlap),
          r"tensor 'blk.1.ssm_out.weight' has data offset \d+, expected \d+: each tensor's data must follow")


def test_misaligned_offset(tiny_gguf, tmp_path):
    def shift(g):
        g.infos[index(g, "blk.2.attn_gate.weight")].offset += 4
    fails(edited(tiny_gguf, tmp_path, shift),
          r"tensor 'blk.2.attn_gate.weight' has data offset \d+, not a multiple of general.alignment = 32")


@pytest.mark.parametrize("align", [1, 2, 4, 8, 16, 64, 128, 4096])
def test_alignment_that_shifts_the_data(tiny_gguf, tmp_path, align):
    """general.alignment set without laying the data out for it: the file loads only when the layout that alignment
    implies is the one written (the same data offset, the same padded offsets, the same end), and then gives the
    same logits; otherwise a clean error."""
    p = edited(tiny_gguf, tmp_path, lambda g: g.set("general.alignment", VT.UINT32, align))
    g = Gguf.read(tiny_gguf)
    g.set("general.alignment", VT.UINT32, align)
    pad = lambda n: -(-n // align) * align                                   # noqa: E731
    at = 0
    holds = pad(len(g.header())) == -(-len(g.header()) // 32) * 32
    for t in g.infos:
        holds = holds and t.offset == at
        at = pad(t.offset + g.nbytes(t))
    holds = holds and pad(len(g.header())) + at == p.stat().st_size
    if not holds:
        fails(p, r"general.alignment|has data offset|bytes follow the last tensor's data|extends past the end")
    else:
        toks = [1, 2, 3]
        assert np.array_equal(Engine.open_sync(p).logits(toks), Engine.open_sync(tiny_gguf).logits(toks))


def test_alignment_laid_out_loads(tiny_gguf, tmp_path):
    def realign(g):
        g.set("general.alignment", VT.UINT32, 256)
        g.relayout(align=256)
    toks = [5, 6, 7]
    p = edited(tiny_gguf, tmp_path, realign)
    assert GGUFFile(p).alignment == 256
    assert np.array_equal(Engine.open_sync(p).logits(toks), Engine.open_sync(tiny_gguf).logits(toks))


@pytest.mark.parametrize("value, vtype, match", [(3, VT.UINT32, "is not a power of two"),
                                                 (0, VT.UINT32, "is not a power of two"),
                                                 (64, VT.UINT16, "stored as UINT16, expected UINT32"),
                                                 (1, VT.BOOL, "stored as BOOL, expected UINT32")])
def test_bad_alignment_value(tiny_gguf, tmp_path, value, vtype, match):
    fails(edited(tiny_gguf, tmp_path, lambda g: g.set("general.alignment", vtype, value)), match)


@pytest.mark.parametrize("tensor", ["blk.0.attn_qkv.weight", "blk.3.ffn_down_shexp.weight"])
def test_retyped_to_a_compatible_block_size(tiny_gguf, tmp_path, tensor):
    """F32 -> F16 keeps every row whole but halves the bytes: the next tensor's offset no longer follows, and the
    last tensor leaves bytes behind it. (Before: the F32 bytes read as F16, NaN from the first token.)"""
    def retype(g):
        g.infos[index(g, tensor)].qtype = int(QType.F16)
    last = tensor == "blk.3.ffn_down_shexp.weight"
    fails(edited(tiny_gguf, tmp_path, retype),
          "bytes follow the last tensor's data" if last else r"has data offset \d+, expected \d+")


def test_trailing_bytes(tiny_gguf, tmp_path):
    p = tmp_path / "t.gguf"
    p.write_bytes(tiny_gguf.read_bytes() + b"\0" * 64)
    fails(p, "64 bytes follow the last tensor's data")


# ---- keys and tensors that llama.cpp refuses ---------------------------------------------------------------------
def test_duplicate_key(tiny_gguf, tmp_path):
    """A second expert_used_count (the last one used to win silently)."""
    def dup(g):
        kv = g.kv("qwen4exp.expert_used_count")
        g.kvs.append(type(kv)(kv.key, VT.UINT32, struct.pack("<I", 8)))
    fails(edited(tiny_gguf, tmp_path, dup), r"metadata key 'qwen4exp.expert_used_count' appears twice \(keys #\d+ "
                                            r"and #\d+\)")


def test_duplicate_tensor(tiny_gguf, tmp_path):
    def dup(g):
        i = index(g, "blk.0.ssm_a")
        g.infos.insert(i + 1, Info(b"blk.0.ssm_a", list(g.infos[i].dims), g.infos[i].qtype, g.infos[i].offset))
    fails(edited(tiny_gguf, tmp_path, dup), "tensor 'blk.0.ssm_a' appears twice")


@pytest.mark.parametrize("key, match", [
    ("tokenizer.ggml.eos_token_id", "key 'tokenizer.ggml.eos_token_id' is stored as an array of UINT32, expected an "
                                    "integer"),
    ("qwen4exp.expert_used_count", r"key 'qwen4exp.expert_used_count' = \[4\] should be an integer"),
])
def test_scalar_stored_as_array(tiny_gguf, tmp_path, key, match):
    def as_array(g):
        kv = g.kv(key)
        kv.value = struct.pack("<IQ", kv.vtype, 1) + kv.value
        kv.vtype = VT.ARRAY
    fails(edited(tiny_gguf, tmp_path, as_array), match)


def test_array_stored_as_scalar_and_nested(tiny_gguf, tmp_path):
    fails(edited(tiny_gguf, tmp_path, lambda g: g.set("tokenizer.ggml.merges", VT.STRING, "a b")),
          "key 'tokenizer.ggml.merges' is stored as STRING, expected an array of strings")
    fails(edited(tiny_gguf, tmp_path, lambda g: g.set("qwen4exp.ple.head_offsets", VT.UINT64, 0)),
          "key 'qwen4exp.ple.head_offsets' = 0 should be an array of integers")

    def nested(g):
        kv = g.kv("qwen4exp.rope.dimension_sections")
        kv.value = struct.pack("<IQ", VT.ARRAY, 1) + kv.value
    fails(edited(tiny_gguf, tmp_path, nested), "'qwen4exp.rope.dimension_sections' is an array of arrays")


@pytest.mark.parametrize("dims, match", [([1 << 32, 1 << 32, 1 << 32], "elements overflow int64"),
                                         ([1 << 40], "extends past the end of the file"),
                                         ([4, 4], "tensor 'extra.weight' is not part of the model")])
def test_extra_tensor(tiny_gguf, tmp_path, dims, match):
    def extra(g):
        g.infos.append(Info(b"extra.weight", dims, int(QType.F32), len(g.data)))
        g.data += b"\0" * 64
    fails(edited(tiny_gguf, tmp_path, extra), match)


def test_block_count_beyond_the_tensors(tiny_gguf, tmp_path):
    """A huge block_count fails before anything is sized by it."""
    def more(g):
        g.set("qwen4exp.block_count", VT.UINT32, (1 << 32) - 1)
        g.kvs = [kv for kv in g.kvs if kv.key != b"qwen4exp.attention.recurrent_layers"]
    fails(edited(tiny_gguf, tmp_path, more), r"block_count' = 4294967295, but the file holds blocks blk.0 .. blk.3")


def test_long_tensor_name(tiny_gguf, tmp_path):
    def rename(g):
        g.infos[0].name = b"x" * 64
    fails(edited(tiny_gguf, tmp_path, rename), "is 64 bytes, at most 63 allowed")


def test_unprintable_names_stay_on_one_line(tiny_gguf, tmp_path):
    def twice(g):
        g.set("x.\ny", VT.UINT32, 1)
        g.kvs.append(g.kvs[-1])
    with pytest.raises(GGUFError, match=r"metadata key 'x.\\ny' appears twice") as e:
        load_model(edited(tiny_gguf, tmp_path, twice))
    assert "\n" not in str(e.value)


# ---- hyperparameter ranges ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["attention.layer_norm_rms_epsilon", "rope.freq_base"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf, -math.inf])
def test_float_hyperparameters(tiny_gguf, tmp_path, key, value):
    """0, negative, NaN, inf: refused (before: NaN logits, exit 0)."""
    match = "must be finite" if not math.isfinite(value) else \
        "must be in \\(0, 1\\)" if "epsilon" in key else "must be a finite number > 1"
    fails(edited(tiny_gguf, tmp_path, lambda g: g.set("qwen4exp." + key, VT.FLOAT32, value)),
          f"key 'qwen4exp.{key}' = .*{match}")


@pytest.mark.parametrize("key, vtype, value, match", [
    ("attention.head_count_kv", VT.UINT32, 0, "'qwen4exp.attention.head_count_kv' = 0 must be > 0"),
    ("attention.indexer.top_k", VT.UINT32, (1 << 32) - 1, r"top_k' = 4294967295 must be in \[1, 65536\]"),
    ("attention.indexer.top_k", VT.UINT32, 18, r"compress_ratios'\[3\] = 4: .* divide attention.indexer.top_k = 18"),
    ("ssm.inner_size", VT.UINT32, 95, "'qwen4exp.ssm.inner_size' = 95, expected time_step_rank x state_size = 96"),
    ("ple.eos_token_id", VT.UINT32, 512, r"'qwen4exp.ple.eos_token_id' = 512 is not a token id in \[0, 512\)"),
    ("context_length", VT.INT32, -1, "'qwen4exp.context_length' = -1 must be >= 0"),
    ("expert_used_count", VT.FLOAT32, 4.0, "'qwen4exp.expert_used_count' = 4.0 should be an integer"),
])
def test_integer_hyperparameters(tiny_gguf, tmp_path, key, vtype, value, match):
    fails(edited(tiny_gguf, tmp_path, lambda g: g.set("qwen4exp." + key, vtype, value)), match)


def test_integer_arrays(tiny_gguf, tmp_path):
    fails(edited(tiny_gguf, tmp_path,
                 lambda g: g.set("qwen4exp.ple.layer_multipliers", VT.ARRAY, [1, -3, 5], VT.INT64)),
          r"'qwen4exp.ple.layer_multipliers' = \[1, -3, 5\] must be uint64")
    fails(edited(tiny_gguf, tmp_path,
                 lambda g: g.set("qwen4exp.attention.compress_ratios", VT.ARRAY, [0.0, 0, 0, math.inf], VT.FLOAT32)),
          "'qwen4exp.attention.compress_ratios' = .* should be an integer or an array of integers, one per layer")
    fails(edited(tiny_gguf, tmp_path,
                 lambda g: g.set("qwen4exp.attention.head_count_kv", VT.ARRAY, [2, 2, 2, 2, 2], VT.UINT32)),
          "'qwen4exp.attention.head_count_kv' has 5 entries, block_count is 4")


# ---- tensor types: checked at load against what the kernels run -------------------------------------------------
@pytest.mark.parametrize("tensor, qtype", [("blk.0.attn_qkv.weight", QType.Q8_1),
                                           ("blk.0.hc_attn_down.weight", QType.Q8_K),
                                           ("blk.3.ffn_up_exps.weight", QType.Q8_1)])
def test_activation_types_as_weights(tiny_gguf, tmp_path, tensor, qtype):
    """Q8_1 and Q8_K are llama.cpp's activation formats: no weight kernel runs them (before: a traceback at the
    first token)."""
    def retype(g):
        g.infos[index(g, tensor)].qtype = int(qtype)
        g.relayout()
    fails(edited(tiny_gguf, tmp_path, retype),
          f"tensor '{tensor}' is {qtype.name}, which strata's CPU kernels do not run as a matrix; the matrix "
          f"types are F32, F16, Q4_0")


def test_tied_embedding_must_be_a_matrix_type(tiny_gguf, tmp_path):
    """token_embd is read by rows (any type) unless it is also the LM head."""
    def tie(g):
        i = index(g, "output.weight")
        del g.infos[i]
        t = g.infos[index(g, "token_embd.weight")]
        t.qtype = int(QType.Q8_1)
        g.relayout()
    fails(edited(tiny_gguf, tmp_path, tie),
          "tensor 'token_embd.weight' is Q8_1, which strata's CPU kernels do not run as the LM head")
