"""The streaming converter: a bf16 checkpoint in the transformers Qwen4-Exp layout (per-expert or fused experts,
one file or shards) -> GGUF whose logits equal transformers' on the same bf16 weights; chunked, threaded and
whole-tensor conversions write the same bytes; byte-level BPE tokenizer.json files in both merges forms tokenize
as HF `tokenizers` does; what cannot be mapped is refused by name; chat templates are kept; progress lines.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from oracle import SPECS, build, hf_logits, rel_err, sequence
from strata.engine import Engine
from strata.model import convert as convert_mod
from strata.model.convert import ConvertError, convert
from strata.model.gguf_file import GGUFFile
from strata.model.loader import load_model
from strata.quant import QType
from strata.tokenizer import Tokenizer

torch = pytest.importorskip("torch")
CLI = Path(__file__).parent.parent / "cli.py"
TOL = 1e-4
SPEC = SPECS["grouped"]           # 3 value heads per key head: the retiling permutations are exercised


def _quiet(*args, **kw):
    with pytest.warns(UserWarning, match="no tokenizer.json"):
        return convert(*args, log=lambda s: None, **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(folder of a bf16 checkpoint, the transformers model holding exactly its values in f32)."""
    root = tmp_path_factory.mktemp("bf16")
    model = build(SPEC, root / "f32")
    model.to(torch.bfloat16).save_pretrained(root / "hf")
    return root / "hf", model.float()


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def _tensor_bytes(path: Path) -> dict[str, tuple[QType, tuple, bytes]]:
    gf = GGUFFile(path)
    return {n: (t.qtype, t.shape, bytes(t.data)) for n, t in gf.tensors.items()}


def test_bf16_checkpoint_logits_match_transformers(ckpt, tmp_path):
    folder, model = ckpt
    dtypes = {v["dtype"] for k, v in _header(folder / "model.safetensors").items() if k != "__metadata__"}
    assert "BF16" in dtypes and "F32" not in dtypes
    _quiet(folder, tmp_path / "m.gguf")
    tokens = sequence(SPEC, 4 * SPEC.budget + 20, seed=SPEC.seed)
    ref = hf_logits(model, tokens)
    out = Engine.open_sync(tmp_path / "m.gguf").logits(tokens)
    err = rel_err(out, ref)
    assert err.max() <= TOL, f"max rel err {err.max():.2e} at position {err.argmax()}"
    assert np.array_equal(out.argmax(-1), ref.argmax(-1))


def test_bf16_outtype_keeps_the_source_bits(ckpt, tmp_path):
    """bf16 -> BF16 is a copy: the embedding's bytes are the checkpoint's (and the norms are 1 + w in F32)."""
    folder, model = ckpt
    _quiet(folder, tmp_path / "m.gguf", "bf16")
    t = GGUFFile(tmp_path / "m.gguf").tensor("token_embd.weight")
    emb = model.model.embed_tokens.weight.detach().to(torch.bfloat16).view(torch.int16).numpy()
    assert t.qtype == QType.BF16 and bytes(t.data) == emb.tobytes()
    norm = GGUFFile(tmp_path / "m.gguf").tensor("output_hc_norm.weight")
    want = model.model.hyper_connection_mixer.hc_norm.weight.detach().numpy() + 1
    assert norm.qtype == QType.F32 and np.array_equal(np.asarray(norm.data).view(np.float32), want)


def test_chunks_and_threads_do_not_change_the_bytes(ckpt, tmp_path, monkeypatch):
    """Every tensor cut into many chunks (row ranges crossing expert, split and permutation boundaries) and
    built on a pool of threads writes the same file as one chunk per tensor on one thread."""
    folder, _ = ckpt
    monkeypatch.setattr(convert_mod, "CHUNK_ELEMENTS", 1 << 30)
    _quiet(folder, tmp_path / "whole.gguf", "q8_0", threads=1)
    monkeypatch.setattr(convert_mod, "CHUNK_ELEMENTS", 100)       # 1-4 rows of 24-256 values per chunk
    seen = []
    _quiet(folder, tmp_path / "chunked.gguf", "q8_0", threads=3, progress=lambda n, d, t: seen.append((n, d)))
    assert (tmp_path / "whole.gguf").read_bytes() == (tmp_path / "chunked.gguf").read_bytes()
    per_tensor = {}
    for name, _ in seen:
        per_tensor[name] = per_tensor.get(name, 0) + 1
    assert per_tensor["blk.0.ffn_gate_exps.weight"] > 8          # progress moves within a tensor
    assert [d for _, d in seen] == sorted(d for _, d in seen)


def _fused_sharded(src: Path, dst: Path) -> None:
    """The same checkpoint with each layer's experts fused (gate_up_proj (n, 2F, E), down_proj (n, E, F)),
    written as two shards."""
    from safetensors.torch import load_file, save_file
    sd = load_file(src / "model.safetensors")
    out = {k: v for k, v in sd.items() if ".experts." not in k}
    for il in range(SPEC.layers):
        m = f"model.layers.{il}.mlp.experts."
        e = range(SPEC.experts)
        out[m + "gate_up_proj"] = torch.stack([torch.cat([sd[f"{m}{i}.gate_proj.weight"],
                                                          sd[f"{m}{i}.up_proj.weight"]]) for i in e]).contiguous()
        out[m + "down_proj"] = torch.stack([sd[f"{m}{i}.down_proj.weight"] for i in e]).contiguous()
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    names = sorted(out)
    half = len(names) // 2
    save_file({k: out[k] for k in names[:half]}, dst / "model-00001-of-00002.safetensors")
    save_file({k: out[k] for k in names[half:]}, dst / "model-00002-of-00002.safetensors")


def test_fused_experts_in_shards_give_the_same_tensors(ckpt, tmp_path):
    folder, _ = ckpt
    _fused_sharded(folder, tmp_path / "fused")
    _quiet(folder, tmp_path / "a.gguf")
    _quiet(tmp_path / "fused", tmp_path / "b.gguf")
    assert _tensor_bytes(tmp_path / "a.gguf") == _tensor_bytes(tmp_path / "b.gguf")


def test_mix_realistic_equals_quantizing_the_f32_file(ckpt, tmp_path):
    """convert --mix gives each tensor make-model's type for it, with the bytes of quantizing the F32 file."""
    from strata.model.quantize_file import quantize_gguf
    from strata.model.synth import pick_type
    folder, _ = ckpt
    _quiet(folder, tmp_path / "f32.gguf")
    _quiet(folder, tmp_path / "mix.gguf", mix="realistic")
    quantize_gguf(tmp_path / "f32.gguf", tmp_path / "q.gguf", "realistic", log=lambda s: None)
    mixed = _tensor_bytes(tmp_path / "mix.gguf")
    assert mixed == _tensor_bytes(tmp_path / "q.gguf")
    m = load_model(tmp_path / "mix.gguf")
    vectors = {s.name for s in convert_mod.all_specs(m.cfg) if s.vector}
    for name, (qt, shape, _) in mixed.items():
        assert qt == (QType.F32 if name in vectors else pick_type(name, shape[0], "realistic")), name
    assert {qt for qt, _, _ in mixed.values()} >= {QType.Q2_0, QType.BF16, QType.Q8_0, QType.F32}
    # the engine runs those types: its logits are those of the same weights dequantized to F32
    from gguf_edit import dequantized_copy
    tokens = sequence(SPEC, 24, seed=5)
    out = Engine.open_sync(tmp_path / "mix.gguf", exact=True).logits(tokens)
    twin = Engine.open_sync(dequantized_copy(tmp_path / "mix.gguf", tmp_path / "twin.gguf")).logits(tokens)
    assert rel_err(out, twin).max() <= TOL


def test_checkpoint_errors_name_the_tensor(ckpt, tmp_path):
    folder, _ = ckpt
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(folder / "config.json", bad / "config.json")
    from safetensors.torch import load_file, save_file
    sd = load_file(folder / "model.safetensors")
    del sd["model.layers.3.self_attn.k_norm.weight"]
    save_file(sd, bad / "model.safetensors")
    with pytest.raises(ConvertError, match=r"no tensor 'model\.layers\.3\.self_attn\.k_norm\.weight'"):
        convert(bad, tmp_path / "x.gguf")
    sd = load_file(folder / "model.safetensors")
    sd["model.layers.0.linear_attn.in_proj_z.weight"] = sd["model.layers.0.linear_attn.in_proj_z.weight"][:-16]
    save_file(sd, bad / "model.safetensors")
    with pytest.raises(ConvertError, match=r"in_proj_z\.weight.*blk\.0\.attn_gate\.weight"):
        convert(bad, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.partial").exists()


def test_a_failure_mid_write_leaves_no_file(ckpt, tmp_path, monkeypatch):
    """A conversion that fails (or is interrupted) after the header is written leaves neither the output nor a
    partial file: a partial 100 GB file is worse than none."""
    from strata.model.safetensors_file import Checkpoint
    calls, rows = [0], Checkpoint.rows

    def failing(self, *args, **kw):
        calls[0] += 1
        if calls[0] == 40:
            raise OSError("disk went away")
        return rows(self, *args, **kw)

    monkeypatch.setattr(Checkpoint, "rows", failing)
    with pytest.raises(OSError, match="disk went away"):
        _quiet(ckpt[0], tmp_path / "x.gguf", threads=1)
    assert calls[0] == 40 and list(tmp_path.iterdir()) == []


# ---- tokenizers ----

QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = ["The lighthouse keeper's notebook: 12345 ships, naïve café, 東京 and Ελληνικά, नमस्ते!\n\tTabs  and   "
          "spaces \r\n it'll be OK, we're done.\n\n"] * 8
PROBE = ("The keeper's NOTEBOOK: 1234567 ships, naïve café — 東京 Ελληνικά नमस्ते!\n\tTabs  and   spaces \r\n "
         "ok  \n\n x<|im_start|>user\nhi there<|im_end|>\n<|endoftext|>  zebra quiz 42%")


def _hf_tokenizer(kind: str):
    """A byte-level BPE trained here, with special tokens appended after the vocab (as Qwen's are)."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HF
    from tokenizers.trainers import BpeTrainer
    tok = HF(models.BPE(ignore_merges=kind == "llama3"))
    if kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex({"qwen2": QWEN2, "qwen35": QWEN35, "llama3": LLAMA3}[kind]), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, BpeTrainer(vocab_size=420, show_progress=False,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return tok


def _with_tokenizer(src: Path, dst: Path, tj: dict | None, files: dict | None = None) -> Path:
    """A copy of the checkpoint folder (weights linked) with this tokenizer.json and other files (relative path
    -> text, or an object written as JSON)."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    if tj is not None:
        (dst / "tokenizer.json").write_text(json.dumps(tj))
    for name, text in (files or {}).items():
        (dst / name).parent.mkdir(exist_ok=True)
        (dst / name).write_text(text if isinstance(text, str) else json.dumps(text))
    return dst


@pytest.mark.parametrize("kind,pre", [("bytelevel", "gpt-2"), ("qwen2", "qwen2"), ("qwen35", "qwen35"),
                                      ("llama3", "llama3")])
@pytest.mark.parametrize("merges", ["lists", "strings"])
def test_byte_level_bpe_tokenizes_as_hf(ckpt, tmp_path, kind, pre, merges):
    from tokenizers import Tokenizer as HF
    hf = _hf_tokenizer(kind)
    tj = json.loads(hf.to_str())
    assert isinstance(tj["model"]["merges"][0], list)
    if merges == "strings":                              # the legacy form: "left right"
        tj["model"]["merges"] = [" ".join(m) for m in tj["model"]["merges"]]
        assert HF.from_str(json.dumps(tj)).encode(PROBE).ids == hf.encode(PROBE).ids
    folder = _with_tokenizer(ckpt[0], tmp_path / "hf", tj)
    convert(folder, tmp_path / "m.gguf", log=lambda s: None)
    meta = GGUFFile(tmp_path / "m.gguf").metadata
    assert meta["tokenizer.ggml.pre"] == pre
    assert len(meta["tokenizer.ggml.tokens"]) == SPEC.vocab                # padded to the model's vocab
    n = hf.get_vocab_size()
    assert set(meta["tokenizer.ggml.token_type"][n:]) == {5}               # UNUSED
    assert meta["tokenizer.ggml.token_type"][hf.token_to_id("<|im_start|>")] == 3       # CONTROL
    tok = Tokenizer.from_metadata(meta)
    want = hf.encode(PROBE, add_special_tokens=False).ids
    assert tok.encode(PROBE) == want
    assert tok.decode(want) == PROBE
    assert len(want) < len(PROBE.encode()) * 0.8                          # the merges were used


def test_unmappable_tokenizers_are_refused_by_name(ckpt, tmp_path):
    good = json.loads(_hf_tokenizer("qwen2").to_str())

    def refused(edit, match: str) -> None:
        tj = json.loads(json.dumps(good))
        edit(tj)
        folder = _with_tokenizer(ckpt[0], tmp_path / f"t{len(list(tmp_path.iterdir()))}", tj)
        with pytest.raises(ConvertError, match=match):
            convert(folder, tmp_path / "x.gguf", log=lambda s: None)
        assert not (tmp_path / "x.gguf").exists()

    refused(lambda tj: tj.update(model={"type": "WordPiece", "vocab": {"a": 0}, "unk_token": "a"}),
            r"tokenizer\.json: model type is 'WordPiece'")
    refused(lambda tj: tj.update(pre_tokenizer={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                                                "split": True}), r"'Metaspace': not a byte-level BPE")
    refused(lambda tj: tj["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\p{L}+|\p{N}+"),
            r"the regexes \['\\\\p\{L\}\+\|\\\\p\{N\}\+'\], which are no GGUF tokenizer\.ggml\.pre's")
    refused(lambda tj: tj.update(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}),
            "add_prefix_space")
    refused(lambda tj: tj["model"]["vocab"].update({"€uro": 430}), r"'€uro' \(id 430\) is not byte-level")
    refused(lambda tj: tj["model"]["vocab"].update({"Ġzz": 9999}), r"id 9999, outside the model's vocab_size 512")
    refused(lambda tj: tj["model"].update(byte_fallback=True), "byte_fallback")
    refused(lambda tj: tj.update(normalizer={"type": "Lowercase"}), "Lowercase")
    refused(lambda tj: tj.update(decoder={"type": "WordPiece", "prefix": "##", "cleanup": True}), "'WordPiece'")


def test_chat_templates_are_kept(ckpt, tmp_path):
    tj = json.loads(_hf_tokenizer("qwen2").to_str())
    tmpl = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    a = _with_tokenizer(ckpt[0], tmp_path / "a", tj, {"tokenizer_config.json": {"chat_template": tmpl,
                                                                                "eos_token": "<|im_end|>"}})
    convert(a, tmp_path / "a.gguf", log=lambda s: None)
    meta = GGUFFile(tmp_path / "a.gguf").metadata
    assert meta["tokenizer.chat_template"] == tmpl
    from strata.chat import ChatFormat
    fmt = ChatFormat(Tokenizer.from_metadata(meta), meta)
    assert fmt.prompt([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    # transformers' order: chat_template.jinja (and additional_chat_templates/) before tokenizer_config.json
    b = _with_tokenizer(ckpt[0], tmp_path / "b", tj, {"tokenizer_config.json": {"chat_template": "old"},
                                                      "chat_template.jinja": "new",
                                                      "additional_chat_templates/tool_use.jinja": "tools"})
    convert(b, tmp_path / "b.gguf", log=lambda s: None)
    meta = GGUFFile(tmp_path / "b.gguf").metadata
    assert meta["tokenizer.chat_template"] == "new" and meta["tokenizer.chat_template.tool_use"] == "tools"
    assert meta["tokenizer.chat_templates"] == ["tool_use"]

    c = _with_tokenizer(ckpt[0], tmp_path / "c", tj, {"tokenizer_config.json": {
        "chat_template": [{"name": "default", "template": "D"}, {"name": "rag", "template": "R"}]}})
    convert(c, tmp_path / "c.gguf", log=lambda s: None)
    meta = GGUFFile(tmp_path / "c.gguf").metadata
    assert meta["tokenizer.chat_template"] == "D" and meta["tokenizer.chat_template.rag"] == "R"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CLI), *map(str, args)], capture_output=True, text=True, timeout=300)


def test_cli_convert_progress_and_errors(ckpt, tmp_path):
    r = _cli("convert", ckpt[0], tmp_path / "m.gguf", "--outtype", "bf16")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("convert ")]
    assert "\r" not in r.stderr and len(lines) >= 10
    got = [tuple(map(float, re.fullmatch(r"convert (\d+\.\d)/(\d+\.\d) MiB", x).groups())) for x in lines]
    assert [d for d, _ in got] == sorted(d for d, _ in got) and got[-1][0] == got[-1][1] > 0
    assert "wrote" in r.stdout

    tj = json.loads(_hf_tokenizer("qwen2").to_str())
    tj["model"]["type"] = "Unigram"
    bad = _with_tokenizer(ckpt[0], tmp_path / "bad", tj)
    for args, msg in [((tmp_path / "nope", tmp_path / "x.gguf"), "no such folder"),
                      ((bad, tmp_path / "x.gguf"), "model type is 'Unigram'"),
                      ((ckpt[0], tmp_path / "x.gguf", "--mix", "fancy"), "unknown mix 'fancy'"),
                      ((ckpt[0], tmp_path / "no" / "x.gguf"), "does not exist")]:
        r = _cli("convert", *args)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and msg in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 or "UserWarning" in r.stderr, r.stderr
        assert not (tmp_path / "x.gguf").exists()
    r = _cli("convert", ckpt[0], tmp_path / "x.gguf", "--mix", "realistic", "--outtype", "bf16")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
