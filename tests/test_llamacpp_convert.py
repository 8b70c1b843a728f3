"""Files written by llama.cpp's own converter (convert_hf_to_gguf.py, llama-cpp-python 0.3.36 sdist) run in
strata with the same parity to transformers as strata's own converter's files.

That converter, under transformers 5.x, writes compress_ratios as all 0 (it tests layer_types for
"full_attention", which the config renamed "indexed_attention"); strata warns and uses ratio 4, so these
checkpoints use ratio 4.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from llamacpp_src import convert_with_llamacpp, converter_dir
from oracle import SPECS, build, hf_logits, rel_err, sequence
from strata.engine import Engine


@pytest.fixture(scope="module")
def llamacpp(tmp_path_factory):
    cache = Path(os.environ.get("STRATA_TEST_CACHE", Path.home() / ".cache" / "strata-test"))
    root = converter_dir(cache)
    if root is None:
        pytest.skip("llama-cpp-python 0.3.36 sdist not available (pip download failed: no network?)")
    return root


def _save_tokenizer(folder: Path, vocab: int, eos: int) -> None:
    """A small byte-level BPE tokenizer.json, as llama.cpp's converter requires one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["a tiny corpus for a tiny tokenizer " * 20],
                            BpeTrainer(vocab_size=min(vocab, 300), special_tokens=["<|endoftext|>"],
                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)


@pytest.mark.parametrize("name", [n for n, s in SPECS.items() if s.ratio == 4])
def test_llamacpp_converted_file_matches_transformers(llamacpp, tmp_path, name):
    spec = SPECS[name]
    model = build(spec, tmp_path / "hf")
    _save_tokenizer(tmp_path / "hf", spec.vocab, spec.eos)
    out = tmp_path / "llama.gguf"
    r = convert_with_llamacpp(llamacpp, tmp_path / "hf", out)
    assert r.returncode == 0, r.stderr[-2000:]
    tokens = sequence(spec, 4 * spec.budget + 20, seed=spec.seed)
    ref = hf_logits(model, tokens)
    with pytest.warns(UserWarning, match="compress_ratios is 0"):
        eng = Engine.open_sync(out)
    got = eng.logits(tokens)
    assert rel_err(got, ref).max() <= 1e-4
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))
