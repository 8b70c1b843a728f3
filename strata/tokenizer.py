"""Byte-level BPE tokenizer of GGUF `tokenizer.ggml.model = "gpt2"` vocabularies (Qwen's), and a small real one
for synthetic models.

Encoding follows llama.cpp (src/llama-vocab.cpp): special tokens written in the text are cut out first, longest
first; each remaining fragment is split by the regexes of its `tokenizer.ggml.pre` type, mapped to GPT-2's byte
alphabet and merged by rank. The split and the merges run in HF `tokenizers` (Rust, Oniguruma regexes): its BPE
merges the lowest-ranked pair, leftmost on ties, exactly as llama.cpp's does, at Rust speed where a Python loop
would dominate prompt processing. The special-token cut is done here because llama.cpp's rule (each token
longest-first over the whole text) is not HF's (leftmost-longest), and because `parse_special` must not mutate a
shared HF object. Like llama.cpp, and unlike transformers' Qwen tokenizers, the text is not NFC-normalized.
"""

from __future__ import annotations

import codecs
import functools
import heapq
import json
import zlib
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from gguf import Keys, TokenType
from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import pre_tokenizers
from tokenizers.models import BPE

_K = Keys.Tokenizer
# token types cut out of the text as single tokens (llama.cpp's special-token cache); plain ints for fast lookups
_SPECIAL_TYPES = frozenset(map(int, (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)))
_BYTE_LEVEL_TYPES = frozenset(map(int, (TokenType.NORMAL, TokenType.BYTE)))


class TokenizerError(ValueError):
    """Tokenizer metadata that cannot be used, or an id outside the vocabulary; the message names the key or id."""


class _Pre(NamedTuple):
    regexes: tuple[str, ...]      # applied in turn; each splits the pieces the previous left, keeping matches and gaps
    ignore_merges: bool = False   # a piece that is itself a token is taken whole (llama3)
    add_bos: bool = False         # llama.cpp's default when the GGUF has no tokenizer.ggml.add_bos_token


# Verbatim from llama.cpp's llm_tokenizer_bpe: its rewrites of the tokenizer.json originals ("(?i:'s|...)" as
# explicit case classes). qwen35 differs from qwen2 by \p{M}: combining marks stay inside letter runs.
_PRE_TYPES: dict[str, _Pre] = {
    "qwen2": _Pre((
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    )),
    "qwen35": _Pre((
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
        r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    )),
    "gpt-2": _Pre((
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    )),
    "llama3": _Pre((
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ), ignore_merges=True, add_bos=True),
    "default": _Pre((
        r"[\p{P}\$\+<=>\^~\|]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"\p{N}+",
        r"[0-9][0-9][0-9]",
    )),
}
_PRE_TYPES["llama-bpe"] = _PRE_TYPES["llama3"]  # the name llama.cpp's converter writes for Llama 3 vocabs


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable latin-1 bytes stand for themselves, the rest move to U+0100 and up.
    Insertion order (printable first) is the id order of the 256 byte tokens in GPT-2 and Qwen vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + k) for k, b in enumerate(moved)}}


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _byte_level_bytes(text: str) -> bytes:
    try:
        return bytes([_CHAR_TO_BYTE[c] for c in text])
    except KeyError:
        # a character outside the byte alphabet: the token is taken as plain UTF-8, as HF's ByteLevel decoder does
        return text.encode("utf-8")


def _pre_tokenizer(pre: _Pre) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _require(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise TokenizerError(f"tokenizer metadata is missing the key {key}")
    return meta[key]


def _token_id(meta: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if not 0 <= int(value) < n_vocab:
        raise TokenizerError(f"{key} = {value} is outside the vocabulary (n_vocab = {n_vocab})")
    return int(value)


class Tokenizer:
    """Text <-> token ids of one GGUF vocabulary. Only a memo of token bytes changes after construction (benignly),
    so one instance serves all threads."""

    def __init__(self, tokens: list[str], index: dict[str, int], token_types: list[int],
                 merges: list[tuple[str, str]], pre: _Pre, *,
                 eos_id: int, bos_id: int | None, pad_id: int | None, add_bos: bool):
        """Use from_metadata, which validates what this takes; `index` maps each token's text to its id."""
        self.n_vocab = len(tokens)
        self.eos_id, self.bos_id, self.pad_id = eos_id, bos_id, pad_id
        self.add_bos = add_bos  # encode() never adds BOS: the prompt builder prepends bos_id when this is set
        self._tokens = tokens
        self._types = token_types
        self._pieces: list[bytes | None] = [None] * self.n_vocab  # token_bytes, filled on first use
        bpe = BPE(vocab=index, merges=merges, ignore_merges=pre.ignore_merges)
        self._bpe = _HFTokenizer(bpe)
        self._bpe.pre_tokenizer = _pre_tokenizer(pre)
        # llama.cpp's special-token cache: CONTROL, USER_DEFINED and UNKNOWN tokens, longest text first
        special = [i for i, t in enumerate(token_types) if t in _SPECIAL_TYPES]
        special.sort(key=lambda i: -len(tokens[i]))
        self._special = [(tokens[i], i) for i in special]
        # with parse_special=False llama.cpp (like HF) still matches USER_DEFINED tokens, never CONTROL/UNKNOWN
        self._user_defined = [(s, i) for s, i in self._special if token_types[i] == TokenType.USER_DEFINED]

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (tokenizer.ggml.* keys); raises TokenizerError naming what is wrong."""
        model = _require(meta, _K.MODEL)
        if model != "gpt2":
            raise TokenizerError(f"{_K.MODEL} = {model!r} is not supported (supported: 'gpt2')")
        pre_name = _require(meta, _K.PRE)
        if pre_name not in _PRE_TYPES:
            raise TokenizerError(f"{_K.PRE} = {pre_name!r} is not supported "
                                 f"(supported: {', '.join(map(repr, _PRE_TYPES))})")
        pre = _PRE_TYPES[pre_name]

        tokens = list(_require(meta, _K.LIST))
        n_vocab = len(tokens)
        if n_vocab == 0:
            raise TokenizerError(f"{_K.LIST} is empty")
        for i, t in enumerate(tokens):
            if not t:  # llama.cpp renames empty tokens the same way
                tokens[i] = f"[EMPTY_{i}]"
        index = dict(zip(tokens, range(n_vocab)))
        if len(index) != n_vocab:
            i = next(i for i, t in enumerate(tokens) if index[t] != i)
            raise TokenizerError(f"{_K.LIST} holds {tokens[i]!r} twice (ids {i} and {index[tokens[i]]})")
        missing = [b for b, c in _BYTE_TO_CHAR.items() if c not in index]
        if missing:
            raise TokenizerError(f"{_K.LIST} lacks byte-level tokens for {len(missing)} of the 256 bytes (first: "
                                 f"byte {missing[0]:#04x} = {_BYTE_TO_CHAR[missing[0]]!r}): not a byte-level vocab")

        types = [int(t) for t in meta.get(_K.TOKEN_TYPE, [TokenType.NORMAL] * n_vocab)]
        if len(types) != n_vocab:
            raise TokenizerError(f"{_K.TOKEN_TYPE} has {len(types)} entries for {n_vocab} tokens")

        merges = []
        for rank, m in enumerate(_require(meta, _K.MERGES)):
            cut = m.find(" ", 1)  # as llama.cpp: from 1, so a merge may start with a space
            if cut < 0:
                raise TokenizerError(f"{_K.MERGES}[{rank}] = {m!r} is not 'left right'")
            pair = (m[:cut], m[cut + 1:])
            for part in (*pair, pair[0] + pair[1]):
                if part not in index:
                    raise TokenizerError(f"{_K.MERGES}[{rank}] = {m!r} names {part!r}, which is not in {_K.LIST}")
            merges.append(pair)

        eos_id = _token_id(meta, _K.EOS_ID, n_vocab)
        if eos_id is None:
            raise TokenizerError(f"tokenizer metadata is missing the key {_K.EOS_ID}")
        bos_id = _token_id(meta, _K.BOS_ID, n_vocab)
        add_bos = bool(meta.get(_K.ADD_BOS, pre.add_bos))
        if add_bos and bos_id is None:
            raise TokenizerError(f"{_K.ADD_BOS} is true but {_K.BOS_ID} is missing")
        return cls(tokens, index, types, merges, pre, eos_id=eos_id, bos_id=bos_id,
                   pad_id=_token_id(meta, _K.PAD_ID, n_vocab), add_bos=add_bos)

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. With parse_special, CONTROL/USER_DEFINED tokens written in it are single tokens."""
        pieces: list[str | int] = [text]
        for special, sid in self._special if parse_special else self._user_defined:
            if special not in text:
                continue
            cut: list[str | int] = []
            for p in pieces:
                if isinstance(p, int) or special not in p:
                    cut.append(p)
                    continue
                for k, part in enumerate(p.split(special)):
                    if k:
                        cut.append(sid)
                    if part:
                        cut.append(part)
            pieces = cut
        ids: list[int] = []
        for p in pieces:
            if isinstance(p, int):
                ids.append(p)
            else:
                ids.extend(self._bpe.encode(p, add_special_tokens=False).ids)
        return ids

    def token_bytes(self, id: int) -> bytes:
        """The bytes one token stands for. Like llama.cpp: CONTROL, USER_DEFINED and UNKNOWN tokens are their text,
        UNUSED and undefined ones are empty, the rest are byte-level (possibly a fragment of a UTF-8 character)."""
        if not 0 <= id < self.n_vocab:
            raise TokenizerError(f"token id {id} is outside the vocabulary (n_vocab = {self.n_vocab})")
        piece = self._pieces[id]
        if piece is None:
            text, kind = self._tokens[id], self._types[id]
            if kind in _SPECIAL_TYPES:
                piece = text.encode("utf-8")
            elif kind in _BYTE_LEVEL_TYPES:
                piece = _byte_level_bytes(text)
            else:
                piece = b""
            self._pieces[id] = piece
        return piece

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD, one per maximal invalid subpart, as in HF
        (Rust's from_utf8_lossy) and llama-cpp-python (errors="replace")."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Text of a growing token sequence, piece by piece, never splitting a UTF-8 character across pieces."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        # Python's incremental UTF-8 decoder holds back an incomplete tail and replaces invalid bytes the same way
        # the one-shot decode does, so the pieces always add up to Tokenizer.decode of the same ids
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# ---- a transformers tokenizer.json (byte-level BPE) -> GGUF metadata ----

# HF writes the contraction group case-insensitively; llama.cpp (and _PRE_TYPES) spell out each case.
_HF_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# The regex of HF's ByteLevel pre-tokenizer (use_regex: GPT-2's). llama.cpp's gpt-2 entry lacks the final
# "|\s+", which changes no split: what that alternative matches is a piece of its own either way.
_HF_BYTE_LEVEL_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_NO_OP_NORMALIZERS = (None, "NFC")      # NFC: ignored, as llama.cpp's converter and loader ignore it


def _kind(obj: Any) -> str | None:
    return obj.get("type") if isinstance(obj, dict) else None


def _hf_pre_name(pt: Any) -> str:
    """The GGUF `tokenizer.ggml.pre` whose regexes split text as the tokenizer.json pre_tokenizer `pt` does."""
    if pt is None:
        raise TokenizerError("there is no pre_tokenizer: not a byte-level BPE tokenizer (ByteLevel expected)")
    steps = (pt.get("pretokenizers") or []) if _kind(pt) == "Sequence" else [pt]
    regexes: list[str] = []
    for i, step in enumerate(steps):
        kind = _kind(step)
        if kind == "Split" and i < len(steps) - 1:
            regex = (step.get("pattern") or {}).get("Regex")
            if regex is None or step.get("behavior") != "Isolated" or step.get("invert"):
                raise TokenizerError(f"pre_tokenizer step {i} is {json.dumps(step)[:200]}: strata maps only a "
                                     f"Split on a Regex with behavior Isolated")
            regex = regex.replace(_HF_CONTRACTIONS, _LLAMA_CONTRACTIONS)
            regexes.append(_PRE_TYPES["gpt-2"].regexes[0] if regex == _HF_BYTE_LEVEL_REGEX else regex)
        elif kind == "ByteLevel" and i == len(steps) - 1:
            if step.get("add_prefix_space"):
                raise TokenizerError("the ByteLevel pre_tokenizer has add_prefix_space: GGUF's gpt2 tokenizer "
                                     "model (llama.cpp, strata) adds no prefix space")
            if step.get("use_regex", True):
                regexes.append(_PRE_TYPES["gpt-2"].regexes[0])
        elif kind == "ByteLevel":
            raise TokenizerError(f"pre_tokenizer step {i} is ByteLevel but not the last step: not mappable")
        else:
            raise TokenizerError(f"pre_tokenizer {'step ' + str(i) + ' ' if len(steps) > 1 else ''}is "
                                 f"{kind or json.dumps(step)[:100]!r}: not a byte-level BPE pre-tokenizer (strata "
                                 f"maps Split(Regex) steps ending in ByteLevel)")
    if not steps or _kind(steps[-1]) != "ByteLevel":
        raise TokenizerError("the pre_tokenizer does not end in ByteLevel: not a byte-level BPE tokenizer")
    for name, pre in _PRE_TYPES.items():
        if pre.regexes == tuple(regexes):
            return name
    raise TokenizerError(f"the pre_tokenizer splits by the regexes {regexes}, which are no GGUF "
                         f"tokenizer.ggml.pre's; strata (like llama.cpp) splits as {', '.join(_PRE_TYPES)} only")


def _special_id(value: Any, ids: Mapping[str, int]) -> int | None:
    """The id of a tokenizer_config token entry ("<|x|>" or {"content": "<|x|>", ...}), None when unset."""
    text = value.get("content") if isinstance(value, dict) else value
    return ids.get(text) if isinstance(text, str) else None


def from_hf_tokenizer_json(tj: Mapping[str, Any], n_vocab: int, eos_id: int | None = None,
                           tokenizer_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """GGUF tokenizer metadata of a transformers tokenizer.json: BPE with a ByteLevel pre-tokenizer (plain, or
    after Split regexes that one of _PRE_TYPES names) and decoder, merges as "a b" strings or [a, b] lists,
    added_tokens as CONTROL (special) or USER_DEFINED; padded with UNUSED "[PADi]" to the model's n_vocab, as
    llama.cpp's converter pads. `eos_id` (the model config's) wins over tokenizer_config's eos_token.
    TokenizerError names what cannot be mapped."""
    cfg = tokenizer_config or {}
    model = tj.get("model")
    if _kind(model) != "BPE":
        raise TokenizerError(f"model type is {_kind(model)!r}: strata maps byte-level BPE only (\"BPE\")")
    for key in ("byte_fallback", "continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key):
            raise TokenizerError(f"the BPE model sets {key} = {model[key]!r}, which GGUF's gpt2 tokenizer model "
                                 f"cannot express")
    normalizer = tj.get("normalizer")
    if _kind(normalizer) == "Sequence" and not normalizer.get("normalizers"):
        normalizer = None
    if _kind(normalizer) not in _NO_OP_NORMALIZERS:
        raise TokenizerError(f"normalizer {json.dumps(normalizer)[:200]} changes the text before it is split; "
                             f"GGUF's gpt2 tokenizer model applies none (NFC alone is accepted and not applied)")
    decoder = tj.get("decoder")
    if decoder is not None and _kind(decoder) != "ByteLevel":
        raise TokenizerError(f"decoder is {_kind(decoder) or json.dumps(decoder)[:100]!r}: not byte-level "
                             f"(ByteLevel expected)")
    pre_name = _hf_pre_name(tj.get("pre_tokenizer"))
    if bool(model.get("ignore_merges", False)) != _PRE_TYPES[pre_name].ignore_merges:
        raise TokenizerError(f"the BPE model has ignore_merges = {bool(model.get('ignore_merges'))}, but "
                             f"GGUF's {pre_name!r} pre-tokenizer implies {_PRE_TYPES[pre_name].ignore_merges}")

    tokens: list[str | None] = [None] * n_vocab
    types = [int(TokenType.NORMAL)] * n_vocab
    added = {}
    for k, a in enumerate(tj.get("added_tokens") or []):
        if not (isinstance(a, dict) and isinstance(a.get("id"), int) and isinstance(a.get("content"), str)):
            raise TokenizerError(f"added_tokens[{k}] = {json.dumps(a)[:100]} has no integer id and string content")
        if not 0 <= a["id"] < n_vocab:
            raise TokenizerError(f"added token {a['content']!r} has id {a['id']}, outside the model's vocab_size "
                                 f"{n_vocab}")
        added[a["id"]] = a
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise TokenizerError("the BPE model has no vocab object")
    for text, i in vocab.items():
        if not isinstance(i, int) or not 0 <= i < n_vocab:
            raise TokenizerError(f"vocab token {text!r} has id {i!r}, outside the model's vocab_size {n_vocab}")
        if tokens[i] is not None:
            raise TokenizerError(f"vocab tokens {tokens[i]!r} and {text!r} both have id {i}")
        bad = next((c for c in text if c not in _CHAR_TO_BYTE), None)
        if bad is not None and i not in added:
            raise TokenizerError(f"vocab token {text!r} (id {i}) is not byte-level: {bad!r} (U+{ord(bad):04X}) is "
                                 f"not one of GPT-2's 256 byte characters")
        tokens[i] = text
    for i, a in added.items():
        tokens[i] = a["content"]
        types[i] = int(TokenType.CONTROL if a.get("special") else TokenType.USER_DEFINED)
    for i, t in enumerate(tokens):
        if t is None:
            tokens[i], types[i] = f"[PAD{i}]", int(TokenType.UNUSED)

    merges = []
    for rank, m in enumerate(model.get("merges") or []):
        pair = m.split(" ") if isinstance(m, str) else m        # the legacy "a b" form or the [a, b] form
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) and p for p in pair)):
            raise TokenizerError(f"merges[{rank}] = {m!r} is neither \"left right\" nor [left, right]")
        if " " in pair[0] or " " in pair[1]:
            raise TokenizerError(f"merges[{rank}] = {m!r} holds a space, which GGUF's \"left right\" form cannot")
        merges.append(f"{pair[0]} {pair[1]}")

    ids = {t: i for i, t in enumerate(tokens)}
    meta: dict[str, Any] = {_K.MODEL: "gpt2", _K.PRE: pre_name, _K.LIST: tokens, _K.TOKEN_TYPE: types,
                            _K.MERGES: merges, _K.ADD_BOS: bool(cfg.get("add_bos_token") is True)}
    eos = eos_id if eos_id is not None else _special_id(cfg.get("eos_token"), ids)
    for key, value in ((_K.EOS_ID, eos), (_K.BOS_ID, _special_id(cfg.get("bos_token"), ids)),
                       (_K.PAD_ID, _special_id(cfg.get("pad_token"), ids))):
        if value is not None:
            meta[key] = int(value)
    Tokenizer.from_metadata(meta)          # what strata (and llama.cpp) would refuse at load is refused now
    return meta


# ---- a small real vocabulary for synthetic models ----

# Training text for build_vocab's merges: plain English written for this purpose.
_TRAINING_TEXT = """\
The lighthouse stood at the end of a long stone pier, and the keeper walked out to it every evening before the \
sun went down. He carried a lamp, a small notebook and a flask of tea. The wind came in from the west most days, \
and when it was strong the waves broke over the pier and he had to wait for the water to fall back before he \
could go on. He did not mind the waiting. He liked to watch the light change on the water, from grey to green to \
a deep blue that was almost black, and he liked the sound of the gulls that followed the fishing boats home.

In his notebook he wrote down the time, the weather, the height of the tide and the names of the ships that \
passed. Some nights there were none at all. Other nights there were so many that he could not write them down \
fast enough, and he would make a mark for each one and count the marks in the morning. Over the years the \
notebooks filled a whole shelf in the cottage, and then a second shelf, and then a box under the bed.

People from the town sometimes asked him what he was writing, and why. He told them that it was his job to keep \
the light burning and to keep a record, and that one was not much use without the other. A light that nobody \
watches, he said, is only a fire; a record that nobody reads is only paper. They laughed at that, but they \
remembered it, and some of them came back years later to ask him about a storm, or a boat, or a night when \
someone they loved had been at sea.

It's easy to think that a job like that is simple. It isn't. The lamp has to be cleaned and trimmed, the glass \
has to be polished, the clockwork that turns the lens has to be wound, and all of it has to be checked again \
and again through the night. When the fog comes in, the horn has to be sounded every thirty seconds, and the \
keeper can't sleep until the fog lifts, which may not be until the next afternoon. In a bad winter he might \
work for three days with only an hour or two of rest.

The town had changed a great deal since he first came. The old market had closed, and the new road had brought \
visitors who stayed for a week in the summer and then went home. The school had fewer children every year. \
But the harbour was still there, and the boats still went out before dawn and came back in the afternoon, \
and as long as they did, somebody would have to keep the light.

When he was young he had wanted to travel. He had read about cities with towers of glass, about trains that \
crossed whole countries in a single night, about markets where you could buy anything you could imagine. He \
never went. At first there was not enough money, and then there was his mother to look after, and then there \
was the light. He did not regret it. He said that the world came to him, one ship at a time, and that he had \
seen more of it from the end of the pier than most people saw from the window of a train.

On the last night of the year the people of the town would walk out along the pier with candles and stand \
together at the foot of the tower. At midnight the keeper would turn the great lamp so that it shone back over \
the town for a moment, and everyone would cheer, and then he would turn it back to face the sea, where it \
belonged. The children thought it was the best part of the whole winter. The older people said it was a way \
of saying thank you, though nobody ever said so out loud.

Years later, when the light was automated and the keeper had retired, the notebooks were given to the museum. \
A young woman who worked there spent a whole summer reading them. She found the names of ships that had been \
lost, and the dates of storms that nobody else had recorded, and little notes in the margins about the birds, \
the weather and the price of bread. She wrote to the keeper to thank him, and he wrote back to say that he was \
glad somebody had finally read them, and that he hoped she had enjoyed the weather reports.
"""

_MAX_MERGES = 1024


def _tie_key(seed: int, pair: tuple[str, str]) -> tuple[int, str, str]:
    # crc32, not hash(): Python salts str hashes per process, and build_vocab must give the same dict every run
    return (zlib.crc32(f"{seed}\0{pair[0]}\0{pair[1]}".encode()), *pair)


@functools.lru_cache(maxsize=4)
def _learned_merges(seed: int) -> tuple[tuple[str, str], ...]:
    """BPE training on _TRAINING_TEXT, split by the qwen35 pre-tokenizer (Qwen3.5 family, as the real model): repeatedly merge the most frequent
    adjacent pair (a seeded hash breaks ties) until no pair occurs twice. Counts are updated incrementally and
    candidates kept in a heap, so training takes tens of milliseconds rather than seconds."""
    split = _pre_tokenizer(_PRE_TYPES["qwen35"]).pre_tokenize_str(_TRAINING_TEXT)
    counted = Counter(piece for piece, _ in split)
    words = [list(w) for w in counted]
    freq = list(counted.values())
    count: Counter[tuple[str, str]] = Counter()
    where: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
    for i, w in enumerate(words):
        for pair in zip(w, w[1:]):
            count[pair] += freq[i]
            where[pair].add(i)
    heap = [(-c, _tie_key(seed, p), p) for p, c in count.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    while heap and len(merges) < _MAX_MERGES:
        neg, _, best = heapq.heappop(heap)
        if count[best] != -neg:
            continue  # stale entry: the count changed after it was pushed
        if -neg < 2:
            break
        merges.append(best)
        joined = best[0] + best[1]
        touched = set()
        for i in where.pop(best):
            old = words[i]
            new, k = [], 0
            while k < len(old):
                if k + 1 < len(old) and (old[k], old[k + 1]) == best:
                    new.append(joined)
                    k += 2
                else:
                    new.append(old[k])
                    k += 1
            for pair in zip(old, old[1:]):
                count[pair] -= freq[i]
                touched.add(pair)
            for pair in zip(new, new[1:]):
                count[pair] += freq[i]
                where[pair].add(i)
                touched.add(pair)
            words[i] = new
        for pair in touched:
            if count[pair] > 0:
                heapq.heappush(heap, (-count[pair], _tie_key(seed, pair), pair))
    return tuple(merges)


def build_vocab(n_vocab: int, eos_id: int, *, seed: int = 0) -> dict[str, Any]:
    """GGUF tokenizer metadata of a small real byte-level BPE vocabulary of exactly n_vocab tokens.

    Ids 0-255 are the byte tokens, then the merges learned from _TRAINING_TEXT (as many as fit, up to
    _MAX_MERGES); "<|endoftext|>" is at eos_id with "<|im_start|>", "<|im_end|>" right after it (or right before
    it when eos_id is within two of the end), all CONTROL; every other id is an UNUSED "<|unused_N|>".
    `seed` breaks ties between equally frequent merges, so different seeds give different, equally valid vocabs.
    """
    if n_vocab < 259:
        raise TokenizerError(f"n_vocab = {n_vocab} is too small: 256 byte tokens and 3 special tokens need 259")
    if not 256 <= eos_id < n_vocab:
        raise TokenizerError(f"eos_id = {eos_id} must be in [256, {n_vocab}): ids 0-255 are the byte tokens")
    chat_ids = [i for i in (eos_id + 1, eos_id + 2, eos_id - 1, eos_id - 2) if 256 <= i < n_vocab][:2]
    im_start, im_end = sorted(chat_ids)
    special = {eos_id: "<|endoftext|>", im_start: "<|im_start|>", im_end: "<|im_end|>"}

    known = set(_BYTE_TO_CHAR.values())
    learned: list[str] = []
    merges: list[str] = []
    for a, b in _learned_merges(seed):
        joined = a + b
        if joined not in known:  # two merges can make the same string; it is one token
            if len(learned) == n_vocab - 256 - len(special):
                break
            known.add(joined)
            learned.append(joined)
        merges.append(f"{a} {b}")

    tokens = list(_BYTE_TO_CHAR.values())
    types = [int(TokenType.NORMAL)] * n_vocab
    rest = iter(learned)
    n_unused = 0
    for i in range(256, n_vocab):
        if i in special:
            tokens.append(special[i])
            types[i] = int(TokenType.CONTROL)
        elif (t := next(rest, None)) is not None:
            tokens.append(t)
        else:
            tokens.append(f"<|unused_{n_unused}|>")
            types[i] = int(TokenType.UNUSED)
            n_unused += 1
    return {
        _K.MODEL: "gpt2",
        _K.PRE: "qwen35",
        _K.LIST: tokens,
        _K.TOKEN_TYPE: types,
        _K.MERGES: merges,
        _K.EOS_ID: eos_id,
        _K.PAD_ID: eos_id,
        _K.ADD_BOS: False,
    }
