"""strata.tokenizer against two oracles built independently from the same vocab + merges:

- transformers' Qwen2Tokenizer / Qwen3_5Tokenizer (HF's own pre-tokenizer config and added-token matching);
- a pure-Python port of llama.cpp's algorithm (the `regex` module with the tokenizer.json regexes, rank-ordered
  BPE, longest-first special-token partition), which also covers the gpt-2, llama3 and default pre types.

Two vocabularies: build_vocab's (merges learned within pre-tokens, as real BPE vocabs are), and a "stress" vocab
whose merges were learned on the raw corpus with no pre-tokenization, so they span digit runs, contractions,
space+punctuation and multi-byte characters: any pre-tokenizer split that differs from the oracle's changes ids.
"""

from __future__ import annotations

import unicodedata
from collections import Counter

import pytest
import regex
from gguf import TokenType
from tokenizers import AddedToken, pre_tokenizers
from transformers import Qwen2Tokenizer, Qwen3_5Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as HF_QWEN2_REGEX
from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX as HF_QWEN35_REGEX

from strata.tokenizer import Tokenizer, TokenizerError, build_vocab

CORPUS = [
    "Hello world",
    " Hello World!  How are you?\n",
    "It's, I'm, we'll, they've, he'd, you're, DON'T, I'M, WE'LL, She'S, o'clock '90s",
    "Numbers: 1234567890, 3.14159, 1,000,000 and 2024-06-01T12:34:56Z; 0x1F 007 -42",
    "   leading spaces\tand\ttabs\n\n\nthree newlines\r\nCRLF  \n  trailing   ",
    "spaces    before\n\n  \n words \n",
    "中文测试：你好，世界！这是一个句子。",
    "日本語のテキスト、カタカナとひらがな。한국어 문장입니다.",
    "Emoji: 🦙🚀👍🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️ end",
    "Ünïcödé àçcéñtš façade naïve café — “quotes” ‘single’ … ½ µ ©",
    "हिन्दी भाषा में नमस्ते दुनिया",
    "Ελληνικά και русский текст, العربية",
    "def f(x):\n    return x**2  # square\n\n\tif x >= 10 && y != 0 { z++; }",
    "$$$ ### !!! ??? ... --- ___ +++ === <<< >>> ||| ~~~ ^^^",
    "x\u00a0y\u2003z\u3000w",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|><|im_start|><tool_call>{\"a\": 1}</tool_call>",
    "<|im_start |> <|im_end| not special <|endoftext|",
    "",
    " ",
    "\n",
    "a",
]
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool_call>"]

# the tokenizer.json regexes (before llama.cpp's rewrites) for the Python oracle; default has no HF original
HF_REGEXES = {
    "qwen2": [HF_QWEN2_REGEX],
    "qwen35": [HF_QWEN35_REGEX],
    "gpt-2": [r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"],
    "llama3": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                r"\p{N}+", r"[0-9][0-9][0-9]"],
}
PRE_TYPES = list(HF_REGEXES)

_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


def gpt2_byte_char(b: int) -> str:
    """GPT-2's bytes_to_unicode, written out: printable latin-1 stays, the other bytes move to U+0100 and up."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    return chr(b) if b in printable else chr(256 + [x for x in range(256) if x not in printable].index(b))


def byte_level(s: str) -> str:
    return "".join(piece for piece, _ in _BYTE_LEVEL.pre_tokenize_str(s))


def byte_token(meta: dict, b: int) -> int:
    return meta["tokenizer.ggml.tokens"].index(gpt2_byte_char(b))


class PyOracle:
    """llama.cpp's BPE tokenization (llama-vocab.cpp) in plain Python, slow and obvious."""

    def __init__(self, meta: dict, pre: str):
        tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(meta["tokenizer.ggml.merges"])}
        self.regexes = [regex.compile(r) for r in HF_REGEXES[pre]]
        self.ignore_merges = pre == "llama3"
        self.special = sorted(((t, i, ty) for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (2, 3, 4)),
                              key=lambda x: -len(x[0]))

    def split(self, text: str) -> list[str]:
        pieces = [text]
        for rx in self.regexes:   # each regex splits every piece into matches and the gaps between them
            out = []
            for p in pieces:
                pos = 0
                for m in rx.finditer(p):
                    out += [p[pos:m.start()]] * (m.start() > pos) + [m.group()]
                    pos = m.end()
                out += [p[pos:]] * (pos < len(p))
            pieces = out
        return pieces

    def bpe(self, word: str) -> list[int]:
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        syms = list(word)
        while True:   # merge the lowest-ranked adjacent pair, leftmost first
            cands = [(self.ranks[p], k) for k, p in enumerate(zip(syms, syms[1:])) if p in self.ranks]
            if not cands:
                return [self.vocab[s] for s in syms]
            _, k = min(cands)
            syms[k:k + 2] = [syms[k] + syms[k + 1]]

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        frags: list[str | int] = [text]
        for s, sid, ty in self.special:   # each special token, longest first, over all remaining raw text
            if not parse_special and ty != TokenType.USER_DEFINED:
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    continue
                parts = f.split(s)
                for k, part in enumerate(parts):
                    out += [sid] * (k > 0) + [part] * (part != "")
            frags = out
        ids: list[int] = []
        for f in frags:
            ids += [f] if isinstance(f, int) else [i for w in self.split(f) for i in self.bpe(byte_level(w))]
        return ids


def hf_oracle(meta: dict, pre: str):
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    cls = {"qwen2": Qwen2Tokenizer, "qwen35": Qwen3_5Tokenizer}[pre]
    hf = cls(vocab={t: i for i, t in enumerate(tokens)},
             merges=[tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]])
    hf.add_tokens([AddedToken(t, special=ty == TokenType.CONTROL, normalized=False)
                   for t, ty in zip(tokens, types) if ty in (TokenType.CONTROL, TokenType.USER_DEFINED)])
    return hf


def with_pre(meta: dict, pre: str) -> dict:
    out = dict(meta, **{"tokenizer.ggml.pre": pre})
    if pre == "llama3":   # llama.cpp's llama3 adds BOS by default, so the file must name one
        out["tokenizer.ggml.bos_token_id"] = out["tokenizer.ggml.eos_token_id"]
    return out


@pytest.fixture(scope="module")
def synthetic() -> dict:
    meta = build_vocab(4096, 4000)
    types = list(meta["tokenizer.ggml.token_type"])
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[4003], types[4003] = USER_DEFINED[0], int(TokenType.USER_DEFINED)  # an unused slot
    return dict(meta, **{"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})


@pytest.fixture(scope="module")
def stress() -> dict:
    plain = [regex.sub("|".join(map(regex.escape, CONTROL + USER_DEFINED)), " ", s) for s in CORPUS]
    seqs = [list(byte_level(s)) for s in plain]   # special tokens never reach BPE: train without them
    tokens = sorted(_BYTE_LEVEL.alphabet())
    merges = []
    for _ in range(400):   # naive BPE training on whole strings: merges cross every pre-tokenizer boundary
        pairs = Counter(p for s in seqs for p in zip(s, s[1:]))
        (a, b), n = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if n < 2:
            break
        merges.append(f"{a} {b}")
        if a + b not in tokens:
            tokens.append(a + b)
        for s in seqs:
            k = 0
            while k < len(s) - 1:
                if s[k] == a and s[k + 1] == b:
                    s[k:k + 2] = [a + b]
                k += 1
    probe = byte_level(" leading")   # a whole word no merge sequence reaches: llama3 (ignore_merges) takes it
    assert probe not in tokens
    tokens.append(probe)
    types = [int(TokenType.NORMAL)] * len(tokens) + [int(TokenType.CONTROL)] * 3 + [int(TokenType.USER_DEFINED)]
    tokens += CONTROL + USER_DEFINED
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>"),
    }


def test_corpus_is_nfc():
    # transformers' Qwen tokenizers NFC-normalize, llama.cpp does not: the shared corpus must not tell them apart
    assert all(unicodedata.normalize("NFC", s) == s for s in CORPUS)


@pytest.mark.parametrize("vocab", ["synthetic", "stress"])
@pytest.mark.parametrize("pre", ["qwen2", "qwen35"])
def test_matches_transformers(vocab, pre, request):
    meta = with_pre(request.getfixturevalue(vocab), pre)
    tok, hf = Tokenizer.from_metadata(meta), hf_oracle(meta, pre)
    for s in CORPUS:
        assert tok.encode(s) == hf.encode(s, add_special_tokens=False), s
        assert tok.encode(s, parse_special=False) == hf.encode(s, add_special_tokens=False,
                                                               split_special_tokens=True), s


@pytest.mark.parametrize("vocab", ["synthetic", "stress"])
@pytest.mark.parametrize("pre", PRE_TYPES)
def test_matches_llama_cpp_algorithm(vocab, pre, request):
    meta = with_pre(request.getfixturevalue(vocab), pre)
    tok, ref = Tokenizer.from_metadata(meta), PyOracle(meta, pre)
    for s in CORPUS:
        assert tok.encode(s) == ref.encode(s), s
        assert tok.encode(s, parse_special=False) == ref.encode(s, parse_special=False), s


def test_stress_vocab_tells_pre_types_apart(stress):
    ids = {pre: [Tokenizer.from_metadata(with_pre(stress, pre)).encode(s) for s in CORPUS] for pre in PRE_TYPES}
    for a in PRE_TYPES:
        for b in PRE_TYPES:
            assert a == b or ids[a] != ids[b], (a, b)
    devanagari = CORPUS.index("हिन्दी भाषा में नमस्ते दुनिया")   # combining marks: the one qwen2/qwen35 difference
    assert [k for k in range(len(CORPUS)) if ids["qwen2"][k] != ids["qwen35"][k]] == [devanagari]
    tok = Tokenizer.from_metadata(stress)
    assert len(tok.encode(CORPUS[devanagari])) == 37
    # llama3's ignore_merges takes the probe word whole; qwen2 reaches it only through merges
    probe = stress["tokenizer.ggml.tokens"].index(byte_level(" leading"))
    assert probe in ids["llama3"][4] and probe not in ids["qwen2"][4]


@pytest.mark.parametrize("pre", PRE_TYPES)
def test_round_trip(synthetic, stress, pre):
    for meta in (synthetic, stress):
        tok = Tokenizer.from_metadata(with_pre(meta, pre))
        for s in CORPUS:
            assert tok.decode(tok.encode(s)) == s
            assert tok.decode(tok.encode(s, parse_special=False)) == s


def test_special_tokens(synthetic):
    tok = Tokenizer.from_metadata(synthetic)
    s = "<|im_start|>user\nhi<|im_end|><tool_call><|endoftext|>"
    ids = tok.encode(s)
    assert [i for i in ids if i >= 4000] == [4001, 4002, 4003, 4000]
    plain = tok.encode(s, parse_special=False)
    assert [i for i in plain if i >= 4000] == [4003]   # USER_DEFINED is matched even then, CONTROL is not
    assert tok.decode(plain) == s and len(plain) > len(ids)
    assert tok.token_bytes(4000) == b"<|endoftext|>" and tok.token_bytes(4003) == b"<tool_call>"
    assert tok.token_bytes(4010) == b""   # UNUSED renders as nothing, as in llama.cpp


def test_empty_tokens_are_renamed_like_llama_cpp(synthetic):
    tokens, types = list(synthetic["tokenizer.ggml.tokens"]), list(synthetic["tokenizer.ggml.token_type"])
    tokens[4010:4012], types[4010:4012] = ["", ""], [int(TokenType.NORMAL)] * 2   # llama.cpp: "[EMPTY_<id>]"
    tok = Tokenizer.from_metadata(dict(synthetic, **{"tokenizer.ggml.tokens": tokens,
                                                     "tokenizer.ggml.token_type": types}))
    assert (tok.token_bytes(4010), tok.token_bytes(4011)) == (b"[EMPTY_4010]", b"[EMPTY_4011]")


def test_special_partition_is_longest_first(synthetic):
    # llama.cpp cuts each special token out of the whole text, longest first; HF would take the leftmost "ab"
    tokens, types = list(synthetic["tokenizer.ggml.tokens"]), list(synthetic["tokenizer.ggml.token_type"])
    tokens[4004:4006], types[4004:4006] = ["ab", "bcd"], [int(TokenType.CONTROL)] * 2
    tok = Tokenizer.from_metadata(dict(synthetic, **{"tokenizer.ggml.tokens": tokens,
                                                     "tokenizer.ggml.token_type": types}))
    assert tok.encode("abcd") == [tokens.index("a"), 4005]


def test_no_normalization(synthetic):
    tok = Tokenizer.from_metadata(synthetic)
    decomposed = "cafe\u0301"
    assert tok.decode(tok.encode(decomposed)) == decomposed
    assert tok.encode(decomposed) == PyOracle(synthetic, "qwen2").encode(decomposed)
    assert tok.encode(decomposed) != hf_oracle(synthetic, "qwen2").encode(decomposed, add_special_tokens=False)


def test_decode_invalid_utf8_like_hf(synthetic):
    tok, hf = Tokenizer.from_metadata(synthetic), hf_oracle(synthetic, "qwen2")
    raw = b"\xe4\xb8a\xff\xf0\x9f\xa6 \xed\xa0\x80z\xc0\xaf"
    ids = [byte_token(synthetic, b) for b in raw]
    assert tok.decode(ids) == hf.decode(ids) == raw.decode("utf-8", errors="replace")
    assert tok.decode(ids) == "\ufffda\ufffd\ufffd \ufffd\ufffd\ufffdz\ufffd\ufffd"


def test_stream_never_splits_a_character(synthetic):
    tok = Tokenizer.from_metadata(synthetic)
    llama = tok.encode("🦙")
    assert len(llama) == 4   # four byte tokens, no merges
    stream = tok.stream()
    assert [stream.push(i) for i in llama] == ["", "", "", "🦙"]
    assert stream.flush() == ""
    held = 0
    for s in CORPUS:
        stream, pieces = tok.stream(), []
        for i in tok.encode(s):
            pieces.append(stream.push(i))
            assert "\ufffd" not in pieces[-1]
        held += pieces.count("")
        assert "".join(pieces) + stream.flush() == s
    # this vocab has no merges inside non-ASCII characters: every byte but a character's last one is held back
    assert held == sum(len(s.encode()) - len(s) for s in CORPUS) == 242


def test_stream_invalid_and_truncated(synthetic):
    tok = Tokenizer.from_metadata(synthetic)
    ids = [byte_token(synthetic, b) for b in b"\xe4\xb8a\xf0\x9f\xa6"]
    stream = tok.stream()
    assert [stream.push(i) for i in ids] == ["", "", "\ufffda", "", "", ""]
    assert stream.flush() == "\ufffd"   # the held, never-completed tail


def base_meta() -> dict:
    return build_vocab(512, 500)


def drop(key):
    return lambda m: m.pop(key)


def put(key, value):
    return lambda m: m.__setitem__(key, value)


def edit_list(key, index, value):
    def f(m):
        m[key] = list(m[key])
        m[key][index] = value
    return f


@pytest.mark.parametrize("mutate, message", [
    (drop("tokenizer.ggml.model"), "missing the key tokenizer.ggml.model"),
    (put("tokenizer.ggml.model", "llama"), "tokenizer.ggml.model = 'llama' is not supported (supported: 'gpt2')"),
    (drop("tokenizer.ggml.pre"), "missing the key tokenizer.ggml.pre"),
    (put("tokenizer.ggml.pre", "qwen9"), "tokenizer.ggml.pre = 'qwen9' is not supported (supported: 'qwen2', "
                                         "'qwen35', 'gpt-2', 'llama3', 'default', 'llama-bpe')"),
    (drop("tokenizer.ggml.tokens"), "missing the key tokenizer.ggml.tokens"),
    (put("tokenizer.ggml.tokens", []), "tokenizer.ggml.tokens is empty"),
    (edit_list("tokenizer.ggml.tokens", 300, "Ġt"), "holds 'Ġt' twice (ids 256 and 300)"),
    (edit_list("tokenizer.ggml.tokens", 0, "<|unused_999|>"), "lacks byte-level tokens for 1 of the 256 bytes "
                                                              "(first: byte 0x21 = '!')"),
    (put("tokenizer.ggml.token_type", [1] * 10), "tokenizer.ggml.token_type has 10 entries for 512 tokens"),
    (drop("tokenizer.ggml.merges"), "missing the key tokenizer.ggml.merges"),
    (edit_list("tokenizer.ggml.merges", 3, "Ġa"), "tokenizer.ggml.merges[3] = 'Ġa' is not 'left right'"),
    (edit_list("tokenizer.ggml.merges", 5, "zz q"), "tokenizer.ggml.merges[5] = 'zz q' names 'zz', which is not "
                                                    "in tokenizer.ggml.tokens"),
    (edit_list("tokenizer.ggml.merges", 5, "q z"), "names 'qz', which is not in tokenizer.ggml.tokens"),
    (drop("tokenizer.ggml.eos_token_id"), "missing the key tokenizer.ggml.eos_token_id"),
    (put("tokenizer.ggml.eos_token_id", 512), "tokenizer.ggml.eos_token_id = 512 is outside the vocabulary "
                                              "(n_vocab = 512)"),
    (put("tokenizer.ggml.bos_token_id", -1), "tokenizer.ggml.bos_token_id = -1 is outside the vocabulary"),
    (put("tokenizer.ggml.add_bos_token", True), "tokenizer.ggml.add_bos_token is true but "
                                                "tokenizer.ggml.bos_token_id is missing"),
])
def test_bad_metadata(mutate, message):
    meta = base_meta()
    mutate(meta)
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_metadata(meta)
    assert message in str(e.value)


def test_bad_ids():
    tok = Tokenizer.from_metadata(base_meta())
    for bad in (512, -1, 10**9):
        with pytest.raises(TokenizerError, match=f"token id {bad} is outside the vocabulary \\(n_vocab = 512\\)"):
            tok.decode([1, bad])
        with pytest.raises(TokenizerError, match=f"token id {bad} is outside"):
            tok.stream().push(bad)


@pytest.mark.parametrize("n_vocab, eos_id, message", [
    (258, 256, "n_vocab = 258 is too small"),
    (512, 255, "eos_id = 255 must be in [256, 512)"),
    (512, 512, "eos_id = 512 must be in [256, 512)"),
])
def test_build_vocab_bad_args(n_vocab, eos_id, message):
    with pytest.raises(TokenizerError, match=regex.escape(message)):
        build_vocab(n_vocab, eos_id)


@pytest.fixture(scope="module")
def real_geometry() -> dict:
    return build_vocab(248320, 248044)


def test_build_vocab_real_geometry(real_geometry):
    meta = real_geometry
    assert meta == build_vocab(248320, 248044)   # deterministic
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    merges = meta["tokenizer.ggml.merges"]
    assert len(tokens) == len(types) == 248320 == len(set(tokens))
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == ("gpt2", "qwen35")
    assert meta["tokenizer.ggml.eos_token_id"] == meta["tokenizer.ggml.padding_token_id"] == 248044
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert tokens[248044:248047] == CONTROL and types[248044:248047] == [3, 3, 3]
    assert len(merges) == 329 and tokens[256:259] == ["Ġt", "he", "Ġthe"]
    assert Counter(types) == {1: 256 + 329, 3: 3, 5: 248320 - 256 - 329 - 3}
    assert tokens[585] == "<|unused_0|>" and tokens[-1] == "<|unused_247731|>"
    tok = Tokenizer.from_metadata(meta)
    assert (tok.n_vocab, tok.eos_id, tok.bos_id, tok.pad_id, tok.add_bos) == (248320, 248044, None, 248044, False)
    assert tok.encode("<|im_start|>assistant\nthe keeper<|im_end|>") == [
        248045, 418, 82, 72, 305, 64, 347, 198, 83, 257, 363, 248046]


def test_build_vocab_tiny():
    meta = build_vocab(512, 500)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == 512 and len(meta["tokenizer.ggml.merges"]) == 253   # every free slot holds a merge
    assert tokens[500:503] == CONTROL and 5 not in types
    at_end = build_vocab(512, 511)["tokenizer.ggml.tokens"]
    assert at_end[509:512] == ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    assert build_vocab(512, 500, seed=1) == build_vocab(512, 500, seed=1) != meta


def test_build_vocab_compresses(real_geometry):
    tok = Tokenizer.from_metadata(real_geometry)
    text = "\n".join(CORPUS)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert (len(ids), len(text.encode())) == (908, 1113)
    english = "The keeper wrote the weather and the names of the ships that passed in the night."
    assert (len(tok.encode(english)), len(english)) == (19, 81)
    assert tok.encode(" the") == [258] and tok.encode("the") == [83, 257]   # "Ġthe" = "Ġt" + "he"


def test_large_text_sanity(real_geometry):
    # throughput sanity without a timed assertion: ~250 KB through encode, decode and the stream
    tok = Tokenizer.from_metadata(real_geometry)
    text = "\n".join(CORPUS) * 200
    ids = tok.encode(text)
    assert len(ids) == 181600 and tok.decode(ids) == text
    stream = tok.stream()
    assert "".join(stream.push(i) for i in ids) + stream.flush() == text
