"""Chat templates against transformers' apply_chat_template, end-of-turn tokens, Qwen tool calls, stop strings."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models
from transformers import PreTrainedTokenizerFast

from strata.chat import (QWEN3_TEMPLATE, TEMPLATE_KEY, TOOL_TEMPLATE_KEY, ChatFormat, ChatTemplateError,
                         ToolCallStream, parse_tool_calls, render)
from strata.engine import Engine
from strata.stops import StopStrings, partial_suffix
from strata.tokenizer import Tokenizer, build_vocab

SPECIAL = {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Das Wetter für eine Stadt (°C)",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {"type": "object"}}},
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}

CHATS = {
    "one turn": [{"role": "user", "content": "Hi"}],
    "system and history with thinking": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n4."},
        {"role": "user", "content": "And 3+3?"},
    ],
    "reasoning field and a trailing assistant turn": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue.", "reasoning_content": "Any will do."},
    ],
    "reasoning under transformers' alias": [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Pear.", "thinking": "Something short."},
        {"role": "user", "content": "Another?"},
    ],
    "tool round trip": [
        {"role": "system", "content": "You help with weather."},
        {"role": "user", "content": "Weather in Zürich and the time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            CALL, {"type": "function", "function": {"name": "now", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "content": "12:00", "name": None},
        {"role": "assistant", "content": "21 °C at noon."},
        {"role": "user", "content": "<tool_response>\nlate\n</tool_response>"},
    ],
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    """A transformers tokenizer whose only role is apply_chat_template: the same special tokens as SPECIAL."""
    vocab = {t: i for i, t in enumerate([*SPECIAL.values(), "<|im_start|>", "[UNK]"])}
    tok = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]")),
                                  **SPECIAL)
    assert tok.special_tokens_map == SPECIAL
    return tok


@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no tools", "tools"])
@pytest.mark.parametrize("thinking", [None, True, False], ids=["thinking default", "thinking on", "thinking off"])
@pytest.mark.parametrize("gen", [True, False], ids=["generation prompt", "no generation prompt"])
def test_qwen3_template_renders_as_transformers(hf_tokenizer, chat, tools, thinking, gen):
    kw = {} if thinking is None else {"enable_thinking": thinking}
    want = hf_tokenizer.apply_chat_template(CHATS[chat], tools=tools, chat_template=QWEN3_TEMPLATE, tokenize=False,
                                            add_generation_prompt=gen, **kw)
    got = render(QWEN3_TEMPLATE, CHATS[chat], tools=tools, add_generation_prompt=gen, **SPECIAL, **kw)
    assert got == want


def test_qwen3_template_known_strings():
    """Independent of transformers: the ChatML turns Qwen documents."""
    assert render(QWEN3_TEMPLATE, CHATS["one turn"]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render(QWEN3_TEMPLATE, CHATS["one turn"], enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tooled = render(QWEN3_TEMPLATE, CHATS["one turn"], tools=TOOLS[:1])
    assert tooled.startswith("<|im_start|>system\n# Tools\n") and '"Das Wetter für eine Stadt (°C)"' in tooled


# transformers' extras: namespace, dict(), loop controls, tojson's options, {% generation %}, the special tokens,
# raise_exception, None values dropped (tool_calls: null is undefined, not None)
EXTRAS = """{{- bos_token }}
{%- set ns = namespace(n=0) %}
{%- for m in messages %}
    {%- if m.role == 'skip' %}{% continue %}{% endif %}
    {%- if m.role == 'stop' %}{% break %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
    {%- if m.role == 'assistant' %}{% generation %}[{{ m.content }}|{{ m.reasoning_content }}]{% endgeneration %}
    {%- else %}{{ m.role }}: {{ m.content }}{{ ' (calls)' if m.tool_calls is defined else '' }}
{% endif %}
{%- endfor %}
{{- dict(a=1, b=[2, 'ü']) | tojson(indent=1, sort_keys=true) }}
{{- tools | tojson(separators=(',', ':')) }} {{ ns.n }}{{ eos_token if add_generation_prompt else '' }}
{%- if messages | length > 6 %}{{ raise_exception('too many messages: ' ~ messages | length) }}{% endif %}"""


def test_transformers_extras_render_the_same(hf_tokenizer):
    msgs = [{"role": "user", "content": "a", "tool_calls": None}, {"role": "skip", "content": "x"},
            {"role": "assistant", "content": "b", "reasoning": "r"}, {"role": "stop", "content": ""},
            {"role": "user", "content": "never"}]
    want = hf_tokenizer.apply_chat_template(msgs, tools=TOOLS[1:], chat_template=EXTRAS, tokenize=False,
                                            add_generation_prompt=True)
    assert render(EXTRAS, msgs, tools=TOOLS[1:], **SPECIAL) == want
    assert "user: a\n[b|r]" in want and want.endswith(" 2<|im_end|>")


def test_template_errors_are_clear():
    with pytest.raises(ChatTemplateError, match="refused the messages: too many messages: 7"):
        render(EXTRAS, [{"role": "user", "content": "a"}] * 7, tools=None, **SPECIAL)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render("{% if %}", [{"role": "user", "content": "a"}])
    with pytest.raises(ChatTemplateError, match="refused"):      # the sandbox: no way to the interpreter
        render("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "a"}])
    with pytest.raises(ChatTemplateError, match="underscore"):
        render("{% set ns = namespace(_x=1) %}", [{"role": "user", "content": "a"}])
    with pytest.raises(ChatTemplateError, match="no messages"):
        render(QWEN3_TEMPLATE, [])


def test_chat_format_of_the_tiny_model(tiny_gguf):
    with Engine.open_sync(tiny_gguf) as e:
        fmt = ChatFormat.of(e)
        tok = e.tokenizer
        im_start, im_end = tok.encode("<|im_start|>"), tok.encode("<|im_end|>")
        assert len(im_start) == len(im_end) == 1                 # control tokens in this vocabulary
        assert fmt.end_of_turn == tuple(sorted({tok.eos_id, im_end[0]}))
        assert fmt.special == {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
        assert fmt.template == QWEN3_TEMPLATE                     # the file has none: Qwen3's
        ids = fmt.prompt_ids(CHATS["one turn"])
        assert ids == [*im_start, *tok.encode("user\nHi"), *im_end, *tok.encode("\n"), *im_start,
                       *tok.encode("assistant\n")]


def test_chat_format_takes_the_files_templates():
    meta = build_vocab(300, 256)
    tok = Tokenizer.from_metadata(meta)
    fmt = ChatFormat(tok, {**meta, TEMPLATE_KEY: "plain:{{ messages[0].content }}",
                           TOOL_TEMPLATE_KEY: "tools:{{ tools | length }}"})
    assert fmt.prompt(CHATS["one turn"]) == "plain:Hi"
    assert fmt.prompt(CHATS["one turn"], TOOLS) == "tools:2"
    assert fmt.end_of_turn == (256, 258)                         # <|endoftext|> and <|im_end|>


# ---- tool calls --------------------------------------------------------------------------------------------------
def _calls(calls):
    return [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_parse_tool_calls():
    args = {"city": "Zürich", "days": [1, {"a": "}"}]}
    one = f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(args, ensure_ascii=False)}}}\n</tool_call>'
    content, calls = parse_tool_calls(one)
    assert content is None and _calls(calls) == [("function", "get_weather", args)]
    assert calls[0]["id"].startswith("call_") and '"Zürich"' in calls[0]["function"]["arguments"]
    two = 'Let me look.\n\n' + one + '\n<tool_call>\n{"name": "now", "arguments": "{}"}\n</tool_call>'
    content, calls = parse_tool_calls(two)
    assert content == "Let me look." and [c[1] for c in _calls(calls)] == ["get_weather", "now"]
    assert calls[0]["id"] != calls[1]["id"]
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    for bad in [one[:-3],                                        # truncated
                one.replace('"arguments"', "arguments"),         # not JSON
                '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
                '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
                '<tool_call>\n{"name": "f", "arguments": "not json"}\n</tool_call>',
                '<tool_call>\n["f"]\n</tool_call>',
                one + "\n<tool_call>\n{\"name\": \"f\"",         # a good call, then a truncated one
                "</tool_call><tool_call>"]:
        assert parse_tool_calls(bad) == (bad, []), bad


@pytest.mark.parametrize("text", [
    'Sure.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "now"}\n</tool_call>',
    'a <toolbox> and <tool_ca',                                  # looks like a call's start, is not
    'x <tool_call>\n{"name": "now", "argu',                      # truncated: all of it is content
    'plain',
])
def test_tool_call_stream_equals_parse(text):
    rng = random.Random(len(text))
    for _ in range(20):
        stream, sent, at = ToolCallStream(), [], 0
        while at < len(text):
            n = rng.randint(1, 5)
            sent.append(stream.push(text[at:at + n]))
            at += n
        rest, calls = stream.finish()
        content, want = parse_tool_calls(text)
        assert _calls(calls) == _calls(want)
        if want:
            assert "<" not in "".join(sent) and ("".join(sent) + rest).strip() == (content or "")
        else:
            assert "".join(sent) + rest == text


# ---- stop strings ------------------------------------------------------------------------------------------------
def _offline(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = sorted((i + len(s), i) for s in stops if (i := text.find(s)) >= 0)
    return (text[:hits[0][1]], True) if hits else (text, False)


def test_stop_strings_hold_across_pieces():
    rng = random.Random(7)
    for trial in range(400):
        text = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        st, out, stopped, at = StopStrings(stops), [], False, 0
        while at < len(text) and not stopped:
            n = rng.randint(1, 6)
            piece, stopped = st.push(text[at:at + n])
            out.append(piece)
            at += n
            assert not any(s in "".join(out) for s in stops)
        emitted = "".join(out) + ("" if stopped else st.flush())
        assert (emitted, stopped) == _offline(text, stops), (trial, text, stops)


def test_stop_strings_cases():
    st = StopStrings(["</s>", "END"])
    assert st.push("hello <") == ("hello ", False)
    assert st.push("/") == ("", False)
    assert st.push("x>") == ("</x>", False)                      # not a stop after all: released
    assert st.push(" E") == (" ", False)
    assert st.push("ND more") == ("", True)
    st = StopStrings(["abcd", "bc"])                             # "bc" is complete first
    assert st.push("abcd") == ("a", True)
    assert StopStrings([]).push("anything") == ("anything", False)
    assert partial_suffix("xx<tool", ["<tool_call>"]) == 5 and partial_suffix("<tool_call>", ["<tool_call>"]) == 0
