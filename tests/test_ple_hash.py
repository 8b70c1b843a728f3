"""PLE hash constants equal transformers' for the real geometry (vocab 248320, seed 1234, 16 heads, base 20M)."""

import pytest

from strata.model import ple_hash

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_constants_equal_transformers_real_geometry():
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp import modeling_qwen4_exp as m
    cfg = Qwen4ExpTextConfig(vocab_size=248320, hidden_size=2560, ple_layer_ids=[2], ngram_size=3,
                             heads_per_ngram=8, ngram_vocab_size_base=20_000_000, seed=1234, eos_token_id=248044,
                             num_hidden_layers=4)
    with torch.device("meta"):        # the 51e9-value table is never allocated
        emb = m.Qwen4ExpTextNGramEmbedding(cfg, 2560, layer_idx=1, ple_layer_index=0)
    mult = m._build_layer_multipliers(248320, 3, 0, 1234).tolist()

    sizes = ple_hash.head_vocab_sizes(20_000_000, 16)
    assert sizes == emb.head_vocab_sizes
    assert ple_hash.head_offsets(sizes) == emb.head_offsets
    assert ple_hash.layer_multipliers(248320, 3, 0, 1234) == mult
    assert len(sizes) == 16 and all(s > 20_000_000 for s in sizes)
    # every product token * multiplier stays below 2^63, so signed (torch) and unsigned (GGUF) hashing agree
    assert max(mult) * 248319 < 2**63


def test_second_ple_layer_continues_the_primes():
    from transformers.models.qwen4_exp import modeling_qwen4_exp as m
    sizes = ple_hash.head_vocab_sizes(1000, 4, ple_layer_index=1)
    assert sizes == [m._find_nth_prime_after(999, 4 + h + 1) for h in range(4)]
