"""Chat: a conversation -> the prompt of the GGUF's `tokenizer.chat_template`, rendered the way transformers'
apply_chat_template renders it; the vocabulary's end-of-turn tokens; Qwen's tool calls parsed out of the reply.

The template is untrusted code from the file: it runs in jinja2's immutable sandbox, with transformers' settings
(trim_blocks, lstrip_blocks, loopcontrols), its globals (raise_exception, strftime_now, dict, a namespace that
refuses underscore names), its tojson (no HTML escaping, ensure_ascii off) and its input normalization (None
values dropped from messages, reasoning aliases, plain JSON data only), so a template gives transformers' string
for the same messages, tools and keyword arguments (tests/test_chat.py checks it against transformers).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np

from strata.stops import partial_suffix
from strata.tokenizer import Tokenizer

TEMPLATE_KEY = "tokenizer.chat_template"
TOOL_TEMPLATE_KEY = "tokenizer.chat_template.tool_use"   # a named template transformers prefers when tools are given
END_OF_TURN = ("<|im_end|>", "<|endoftext|>")            # Qwen's end-of-turn and end-of-text control tokens
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")   # transformers' aliases, standard one first

# Qwen3's chat template (Qwen/Qwen3-0.6B's tokenizer_config.json): tools in the system turn, <tool_call> JSON
# blocks, <think> handling, enable_thinking. The template of a GGUF that has none: qwen4exp is a Qwen model and
# its vocabulary carries <|im_start|>/<|im_end|>.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


class ChatTemplateError(ValueError):
    """The template cannot be compiled, or refused these messages (its raise_exception) or failed on them."""


@functools.lru_cache(maxsize=8)
def compile_template(source: str):
    """The jinja2 template of `source` in transformers' sandboxed environment (compiled once per source)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """transformers' {% generation %} tag (it marks the assistant's tokens): renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """namespace() without underscore attributes (a way out of the sandbox), as transformers'."""
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot store the attribute {name!r} on a "
                                                      f"namespace (underscore names are refused)")

    class Dict:
        """dict() for templates, without the type's attributes."""
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=Dict(), namespace=Namespace)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None


def _plain(value: Any) -> Any:
    """Only plain JSON data reaches the template (transformers' rule: rich objects carry methods the sandbox
    does not know to be dangerous); anything else becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _message(m: Mapping) -> dict:
    """One message as transformers gives it to the template: None values dropped, reasoning under every alias."""
    m = {k: v for k, v in _plain(m).items() if v is not None}
    reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
    if reasoning is not None:
        m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    return m


def render(source: str, messages: Sequence[Mapping], *, tools: Sequence[Mapping] | None = None,
           add_generation_prompt: bool = True, **kwargs) -> str:
    """The prompt text of `messages` (dicts with role, content, ...) under the template `source`; `kwargs` are the
    template's variables (the special tokens, enable_thinking, ...), as apply_chat_template(tokenize=False)."""
    import jinja2
    if not messages:
        raise ChatTemplateError("no messages: a chat needs at least one")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"message {i} is not an object with a role and content: {m!r}")
    template = compile_template(source)
    try:
        return template.render(messages=[_message(m) for m in messages], tools=_plain(tools), documents=None,
                               add_generation_prompt=add_generation_prompt, **_plain(kwargs))
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template refused the messages: {e}") from None
    except (TypeError, AttributeError, ValueError, LookupError) as e:
        raise ChatTemplateError(f"the chat template failed on the messages: {type(e).__name__}: {e}") from None


def _special_id(tok: Tokenizer, text: str) -> int | None:
    """The id of a control token spelled `text`: one id with special parsing, other ids without it."""
    ids = tok.encode(text)
    return ids[0] if len(ids) == 1 and tok.encode(text, parse_special=False) != ids else None


class ChatFormat:
    """How one model's conversations become prompts: its template (the tool-use variant when tools are given and
    the file has one), its special tokens as template variables, and the ids that end an assistant turn."""

    def __init__(self, tokenizer: Tokenizer, metadata: Mapping[str, Any]):
        self.tokenizer = tokenizer
        self.template = metadata.get(TEMPLATE_KEY) or QWEN3_TEMPLATE
        self.tool_template = metadata.get(TOOL_TEMPLATE_KEY)
        # apply_chat_template passes the tokenizer's special tokens map the same way
        self.special = {name: tokenizer.token_bytes(i).decode("utf-8", errors="replace")
                        for name, i in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id),
                                        ("pad_token", tokenizer.pad_id)) if i is not None}
        ends = {tokenizer.eos_id, metadata.get("tokenizer.ggml.eot_token_id"), *map(
            functools.partial(_special_id, tokenizer), END_OF_TURN)}
        self.end_of_turn = tuple(sorted(int(i) for i in ends if i is not None and 0 <= int(i) < tokenizer.n_vocab))

    @classmethod
    def of(cls, engine) -> "ChatFormat":
        return cls(engine.tokenizer, engine.model.metadata)

    def prompt(self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None, **kwargs) -> str:
        source = self.tool_template if tools and self.tool_template else self.template
        return render(source, messages, tools=tools or None, **{**self.special, **kwargs})

    def prompt_ids(self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None, **kwargs) -> list[int]:
        """Token ids of the prompt: special tokens in the text are parsed; BOS is prepended when the vocabulary
        asks for it and the template did not write it."""
        tok = self.tokenizer
        ids = tok.encode(self.prompt(messages, tools, **kwargs))
        if tok.add_bos and ids[:1] != [tok.bos_id]:
            ids.insert(0, tok.bos_id)
        return ids


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Qwen's (Hermes') tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, in
    OpenAI's shape (arguments as a JSON string). Returns (content, calls): the text outside the blocks (None when
    blank) and the calls; a truncated or malformed block leaves the whole text as content, with no calls."""
    if TOOL_OPEN not in text:
        return text, []
    calls, outside, pos = [], [], 0
    while (a := text.find(TOOL_OPEN, pos)) >= 0:
        b = text.find(TOOL_CLOSE, a)
        if b < 0:
            return text, []
        outside.append(text[pos:a])
        call = _tool_call(text[a + len(TOOL_OPEN):b])
        if call is None:
            return text, []
        calls.append(call)
        pos = b + len(TOOL_CLOSE)
    outside.append(text[pos:])
    return "".join(outside).strip() or None, calls


def _tool_call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):                  # already JSON text: it must hold an object
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class ToolCallStream:
    """Streams a reply's content while holding back tool calls: everything from the first `<tool_call>` on (and
    an end that could be its start) waits for finish(), which parses it."""

    def __init__(self):
        self.text = ""
        self.sent = 0                  # text[:sent] went out as content
        self.calling = False           # a <tool_call> was seen at text[sent]

    def push(self, piece: str) -> str:
        """The content that can go out now."""
        self.text += piece
        if self.calling:
            return ""
        a = self.text.find(TOOL_OPEN, self.sent)
        if a >= 0:
            self.calling = True
        else:
            a = len(self.text) - partial_suffix(self.text[self.sent:], (TOOL_OPEN,))
        out, self.sent = self.text[self.sent:a], a
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """The content not sent yet and the tool calls (none when the held text does not parse as calls)."""
        rest = self.text[self.sent:]
        content, calls = parse_tool_calls(rest)
        return (content or "", calls) if calls else (rest, [])
