"""engine.chat: template → format detection, parsing generated answers whole and streamed.

Sample outputs are written from each format's public description (llama.cpp's function-calling
docs and the models' chat templates). Every well-formed sample is also cut at every character:
each prefix, parsed as partial, must be a prefix-consistent view of the whole answer, and the
streamed deltas must add up to the final message.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.chat import (
    ChatFormat,
    ChatMessage,
    ChatStream,
    ToolCall,
    ToolFormat,
    detect_format,
    generation_opens_reasoning,
    parse_output,
)
from engine.chat import parse as chat_parse
from engine.chat.parse import ParseOptions
from engine.chat.parse_json import Memo

TEMPLATES = Path(__file__).parent / "templates"
THINK = ("<think>", "</think>")
QWEN_XML = ChatFormat(ToolFormat.QWEN_XML, *THINK)
QWEN_CODER = ChatFormat(ToolFormat.QWEN_XML)
HERMES = ChatFormat(ToolFormat.HERMES)
QWEN3 = ChatFormat(ToolFormat.HERMES, *THINK)
LLAMA3 = ChatFormat(ToolFormat.LLAMA3)
MISTRAL = ChatFormat(ToolFormat.MISTRAL_NEMO)
DEEPSEEK = ChatFormat(ToolFormat.DEEPSEEK_R1, *THINK)
GENERIC = ChatFormat(ToolFormat.GENERIC)

# what may never show in streamed content of a well-formed answer: the start of a marker
FRAGMENTS = ("<tool", "</thi", "<thi", "[TOOL", "<|python", "<｜tool", "<function", "<parameter")
WEATHER = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "zip": {"type": "string"}, "hours": {"type": "array"}, "opts": {"type": "object"},
    "ratio": {"type": "number"}, "note": {"type": ["string", "null"]}}}}


# ---------------------------------------------------------------------------------------------
# detect_format, generation_opens_reasoning


@pytest.mark.parametrize("snippet,tools,think", [
    # Qwen 3.5 / Qwen3-Coder: XML calls (Qwen3-Coder has no think block)
    ("<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1"
     " {{- '<think>\\n' }}", ToolFormat.QWEN_XML, True),
    ("<tool_call>\\n<function=' + tool_call.name + '>\\n' ... '<parameter=' + args_name",
     ToolFormat.QWEN_XML, False),
    # Qwen 3: Hermes calls with reasoning_content in history
    ("{%- if message.reasoning_content is string %} ... <tool_call>\\n{\"name\": <function-name>",
     ToolFormat.HERMES, True),
    # Hermes 2 Pro, Qwen 2.5
    ("<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-dict>}\n</tool_call>",
     ToolFormat.HERMES, False),
    # Llama 3.1: ipython role, <|python_tag|>
    ("<|start_header_id|>ipython<|end_header_id|>\\n\\n ... <|python_tag|>", ToolFormat.LLAMA3, False),
    ("<|start_header_id|>system<|end_header_id|> {%- if tools is not none %}", ToolFormat.LLAMA3, False),
    # Mistral Nemo
    ("{{- \"[TOOL_CALLS][\" }} {%- for tool_call in message.tool_calls %}", ToolFormat.MISTRAL_NEMO, False),
    # DeepSeek R1 (official and llama.cpp's template)
    ("'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'",
     ToolFormat.DEEPSEEK_R1, True),
    # Llama 3 without tools, Gemma, no template at all: generic
    ("<|start_header_id|>' + message['role'] + '<|end_header_id|>", ToolFormat.GENERIC, False),
    ("<start_of_turn>model\n", ToolFormat.GENERIC, False),
    ("", ToolFormat.GENERIC, False),
    (None, ToolFormat.GENERIC, False),
])
def test_detect_format_snippets(snippet, tools, think):
    fmt = detect_format(snippet)
    assert fmt.tools is tools
    assert (fmt.think_open, fmt.think_close) == (THINK if think else (None, None))


def test_detect_format_test_templates():
    assert detect_format((TEMPLATES / "qwen35_xml.jinja").read_text()) == QWEN_XML
    assert detect_format((TEMPLATES / "hermes.jinja").read_text()) == HERMES


def test_generation_opens_reasoning():
    assert generation_opens_reasoning("<|im_start|>assistant\n<think>\n", QWEN_XML)
    assert generation_opens_reasoning("<｜Assistant｜><think>", DEEPSEEK)
    assert not generation_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", QWEN_XML)
    assert not generation_opens_reasoning("<|im_start|>assistant\n", QWEN_XML)
    assert not generation_opens_reasoning("<|im_start|>assistant\n<think>\n", HERMES)


# ---------------------------------------------------------------------------------------------
# Samples: (id, format, output, options, expected final message)


@dataclass
class Sample:
    id: str
    fmt: ChatFormat
    text: str
    content: str = ""
    reasoning: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments)
    ids: list[str] | None = None
    opts: dict = field(default_factory=dict)
    well_formed: bool = True


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def hermes_call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def ds_call(name: str, args: str, begin: str = "<｜tool▁call▁begin｜>") -> str:
    return f"{begin}function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"

SAMPLES = [
    # --- Qwen 3.5 XML
    Sample("xml-reasoning-text-two-calls", QWEN_XML,
           "<think>\nThe user wants two cities.\n</think>\n\nI'll check both.\n\n"
           + xml_call("get_weather", city="Paris", days="3") + "\n"
           + xml_call("get_weather", city="São Paulo", days="1"),
           content="I'll check both.", reasoning="The user wants two cities.",
           calls=[("get_weather", '{"city": "Paris", "days": 3}'),
                  ("get_weather", '{"city": "São Paulo", "days": 1}')],
           opts={"tool_schemas": WEATHER}),
    Sample("xml-in-reasoning", QWEN_XML,
           "Need the weather tool.\n</think>\n\n" + xml_call("get_weather", city="Oslo"),
           reasoning="Need the weather tool.", calls=[("get_weather", '{"city": "Oslo"}')],
           opts={"in_reasoning": True, "tool_schemas": WEATHER}),
    Sample("xml-reasoning-ends-at-call", QWEN_XML,
           "Calling it right away.\n\n" + xml_call("get_weather", city="Rome"),
           reasoning="Calling it right away.", calls=[("get_weather", '{"city": "Rome"}')],
           opts={"in_reasoning": True, "tool_schemas": WEATHER}),
    Sample("xml-typed", QWEN_XML,
           xml_call("get_weather", city="42", zip="007", days="14", metric="true", ratio="0.5",
                    hours="[1, 2]", opts='{"a": {"b": null}}', note="null"),
           calls=[("get_weather", '{"city": "42", "zip": "007", "days": 14, "metric": true, "ratio": 0.5, '
                                  '"hours": [1, 2], "opts": {"a": {"b": null}}, "note": null}')],
           opts={"tool_schemas": WEATHER}),
    Sample("xml-typed-fallback", QWEN_XML,
           xml_call("get_weather", days="a few", metric="yes", note="none at all"),
           calls=[("get_weather", '{"days": "a few", "metric": "yes", "note": "none at all"}')],
           opts={"tool_schemas": WEATHER}),
    Sample("xml-no-schema", QWEN_CODER,
           "Running it.\n" + xml_call("run", code="print('hi')\nif a < b:\n    pass", n="3", flag="false",
                                      v="2024-01-01", empty=""),
           content="Running it.",
           calls=[("run", '{"code": "print(\'hi\')\\nif a < b:\\n    pass", "n": 3, "flag": false, '
                          '"v": "2024-01-01", "empty": ""}')]),
    Sample("xml-no-params", QWEN_CODER, xml_call("now"), calls=[("now", "{}")]),
    Sample("xml-reasoning-off", QWEN_XML,
           "<think>\nhmm\n</think>\n\nDone.", content="<think>\nhmm\n</think>\n\nDone.",
           opts={"reasoning": False}),
    Sample("xml-tools-off", QWEN_XML,
           "<think>\nhmm\n</think>\n\nUse " + xml_call("x", a="1"),
           content="Use " + xml_call("x", a="1"), reasoning="hmm", opts={"tools": False}),
    Sample("xml-unclosed-think", QWEN_XML, "<think>\nStill thinking about it",
           reasoning="Still thinking about it"),
    Sample("xml-plain-lt", QWEN_CODER, "Use a<b and <br> or <tool> tags.",
           content="Use a<b and <br> or <tool> tags."),
    Sample("xml-malformed", QWEN_CODER, "Try:\n<tool_call>\n<oops>\n</tool_call>",
           content="Try:\n<tool_call>\n<oops>\n</tool_call>", well_formed=False),
    Sample("xml-truncated", QWEN_CODER, "<tool_call>\n<function=run>\n<parameter=code>\nprint(",
           calls=[("run", '{"code": "print(')], well_formed=False),  # cut by max_tokens: the call so far
    Sample("xml-truncated-after-a-parameter", QWEN_CODER,
           "Running it.\n<tool_call>\n<function=run>\n<parameter=n>\n3\n</parameter>\n<parameter=code>\npri",
           content="Running it.", calls=[("run", '{"n": 3, "code": "pri')], well_formed=False),
    Sample("xml-truncated-in-a-closing-tag", QWEN_CODER,
           "<tool_call>\n<function=run>\n<parameter=code>\nsay \"hi\"\n</param",
           calls=[("run", '{"code": "say \\"hi\\"')], well_formed=False),
    Sample("xml-truncated-after-a-newline", QWEN_CODER, "<tool_call>\n<function=run>\n<parameter=city>\nOslo\n",
           calls=[("run", '{"city": "Oslo')], well_formed=False),  # the newline may be the tag's
    Sample("xml-truncated-in-a-number", QWEN_CODER, "<tool_call>\n<function=run>\n<parameter=n>\n12",
           calls=[("run", '{"n": 12')], well_formed=False),
    Sample("xml-truncated-at-a-value", QWEN_CODER, "<tool_call>\n<function=run>\n<parameter=code>",
           calls=[("run", '{"code": "')], well_formed=False),
    Sample("xml-truncated-before-its-name-ends", QWEN_CODER, "<tool_call>\n<function=ru",
           content="<tool_call>\n<function=ru", well_formed=False),  # no name, no call
    # --- Hermes 2 Pro / Qwen 2.5 / Qwen 3
    Sample("hermes-text-two-calls", HERMES,
           "Let me look.\n" + hermes_call("get_weather", '{"location":"Paris",  "unit": "c"}') + "\n"
           + hermes_call("get_time", '{ "tz": "Europe/Paris" }'),
           content="Let me look.",
           calls=[("get_weather", '{"location":"Paris",  "unit": "c"}'),
                  ("get_time", '{ "tz": "Europe/Paris" }')]),
    Sample("hermes-args-first", HERMES,
           '<tool_call>\n{"arguments": {"q": "x\\"y"}, "name": "search"}\n</tool_call>',
           calls=[("search", '{"q": "x\\"y"}')]),
    Sample("hermes-qwen3-reasoning", QWEN3,
           "<think>\nI need the time.\n</think>\n\n" + hermes_call("get_time", "{}"),
           reasoning="I need the time.", calls=[("get_time", "{}")]),
    Sample("hermes-text-after", HERMES,
           hermes_call("a", '{"n": [1, {"m": "}"}]}') + "\nCalled it.",
           content="Called it.", calls=[("a", '{"n": [1, {"m": "}"}]}')]),
    Sample("hermes-plain", HERMES, "No tools needed: 2 < 3, {ok}.",
           content="No tools needed: 2 < 3, {ok}."),
    Sample("hermes-bad-json", HERMES, "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": }\n</tool_call>",
           content="<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": }\n</tool_call>", well_formed=False),
    Sample("hermes-args-string", HERMES,
           '<tool_call>\n{"name": "a", "arguments": "{}"}\n</tool_call>',
           content='<tool_call>\n{"name": "a", "arguments": "{}"}\n</tool_call>', well_formed=False),
    # --- Llama 3.x
    Sample("llama3-bare", LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}',
           calls=[("get_weather", '{"city": "Paris"}')]),
    Sample("llama3-python-tag", LLAMA3,
           '<|python_tag|>{"type": "function", "name": "get_time", "parameters": {}}',
           calls=[("get_time", "{}")]),
    Sample("llama3-several", LLAMA3,
           '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [2]}}',
           calls=[("a", '{"x": 1}'), ("b", '{"y": [2]}')]),
    Sample("llama3-text", LLAMA3, "Paris is sunny today.", content="Paris is sunny today."),
    Sample("llama3-json-answer", LLAMA3, '{"answer": 42}', content='{"answer": 42}'),
    # --- Mistral Nemo
    Sample("mistral-two-calls", MISTRAL,
           '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123def"},'
           ' {"name": "get_time", "arguments": {}, "id": "Xyz987uvw"}]',
           calls=[("get_weather", '{"city": "Paris"}'), ("get_time", "{}")], ids=["abc123def", "Xyz987uvw"]),
    Sample("mistral-no-id-text-before", MISTRAL,
           'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Nice"}}]',
           content="Checking.", calls=[("get_weather", '{"city": "Nice"}')]),
    Sample("mistral-bad", MISTRAL, "[TOOL_CALLS] oops", content="[TOOL_CALLS] oops", well_formed=False),
    # --- DeepSeek R1
    Sample("deepseek-in-reasoning-two-calls", DEEPSEEK,
           "The user asks for weather and time.\n</think>\n\n" + DS_BEGIN
           + ds_call("get_weather", '{"city": "Paris"}') + "\n" + ds_call("get_time", "{}") + DS_END,
           reasoning="The user asks for weather and time.",
           calls=[("get_weather", '{"city": "Paris"}'), ("get_time", "{}")], opts={"in_reasoning": True}),
    Sample("deepseek-think-text-variant", DEEPSEEK,
           "<think>\nshort\n</think>\n\nSure.\n<｜tool_calls_begin｜>" + ds_call("f", '{\n  "a": 1\n}', begin="")
           + DS_END,
           content="Sure.", reasoning="short", calls=[("f", '{\n  "a": 1\n}')]),
    Sample("deepseek-answer", DEEPSEEK, "Thinking done.\n</think>\n\nIt is 4.",
           content="It is 4.", reasoning="Thinking done.", opts={"in_reasoning": True}),
    # --- Generic
    Sample("generic-call", GENERIC, '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}',
           calls=[("get_weather", '{"city": "Paris"}')]),
    Sample("generic-calls", GENERIC,
           '{\n  "tool_calls": [\n    {"name": "a", "arguments": {"x": 1}},\n'
           '    {"name": "b", "arguments": {}, "id": "b-1"}\n  ]\n}',
           calls=[("a", '{"x": 1}'), ("b", "{}")]),  # only Mistral's ids are taken
    Sample("generic-response", GENERIC, '{"response": "Hello \\"world\\" \\u00e9\\ud83d\\ude00\\n!"}',
           content='Hello "world" é\U0001F600\n!'),
    Sample("generic-text", GENERIC, "Just text.", content="Just text."),
    Sample("generic-other-json", GENERIC, '{"foo": [1, 2]}', content='{"foo": [1, 2]}'),
    Sample("generic-trailing-garbage", GENERIC, '{"foo": 1} and more', content='{"foo": 1} and more'),
]


def expected(sample: Sample) -> ChatMessage:
    ids = sample.ids or [f"call_{i}" for i in range(len(sample.calls))]
    return ChatMessage(sample.content, sample.reasoning,
                       [ToolCall(n, a, i) for (n, a), i in zip(sample.calls, ids)])


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.id)
def test_final_parse(sample):
    msg = parse_output(sample.text, sample.fmt, partial=False, **sample.opts)
    assert msg == expected(sample)
    for call in msg.tool_calls if sample.well_formed else ():
        assert isinstance(json.loads(call.arguments), dict)


def has_fragment(text: str) -> bool:
    return any(f in text for f in FRAGMENTS)


def assert_prefix_view(part: ChatMessage, final: ChatMessage) -> None:
    assert final.content.startswith(part.content)
    assert final.reasoning_content.startswith(part.reasoning_content)
    assert len(part.tool_calls) <= len(final.tool_calls)
    for p, f in zip(part.tool_calls, final.tool_calls):
        assert (p.name, p.id) == (f.name, f.id)
        assert f.arguments.startswith(p.arguments)


@pytest.mark.parametrize("sample", [s for s in SAMPLES if s.well_formed], ids=lambda s: s.id)
def test_every_prefix_is_a_consistent_view(sample):
    final = parse_output(sample.text, sample.fmt, partial=False, **sample.opts)
    for cut in range(len(sample.text) + 1):
        part = parse_output(sample.text[:cut], sample.fmt, partial=True, **sample.opts)
        assert_prefix_view(part, final)
        if not has_fragment(final.content):  # reasoning=False shows <think> on purpose
            assert not has_fragment(part.content), (cut, part.content)
        assert not has_fragment(part.reasoning_content), (cut, part.reasoning_content)


def stream(text: str, fmt: ChatFormat, sizes, opts: dict) -> tuple[list[dict], ChatMessage]:
    s = ChatStream(fmt, **opts)
    deltas: list[dict] = []
    i = 0
    for size in sizes:
        if i >= len(text):
            break
        deltas += s.feed(text[i:i + size])
        i += size
    deltas += s.feed(text[i:])
    tail, final = s.finish()
    return deltas + tail, final


def reassemble(deltas: list[dict]) -> ChatMessage:
    """The message the deltas add up to, checking the OpenAI delta shapes on the way."""
    msg = ChatMessage()
    for d in deltas:
        assert len(d) == 1
        msg.content += d.get("content", "")
        msg.reasoning_content += d.get("reasoning_content", "")
        for tc in d.get("tool_calls", []):
            i = tc["index"]
            if i == len(msg.tool_calls):
                assert tc["type"] == "function" and tc["id"]
                msg.tool_calls.append(ToolCall(tc["function"]["name"], tc["function"]["arguments"], tc["id"]))
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                msg.tool_calls[i].arguments += tc["function"]["arguments"]
    return msg


def piece_sizes(kind, seed: int = 0):
    if isinstance(kind, int):
        while True:
            yield kind
    rng = random.Random(seed)
    while True:
        yield rng.randint(1, 12)


@pytest.mark.parametrize("kind", [1, 2, 3, "random"])
@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.id)
def test_stream_adds_up(sample, kind):
    for seed in range(3 if kind == "random" else 1):
        deltas, final = stream(sample.text, sample.fmt, piece_sizes(kind, seed), sample.opts)
        assert reassemble(deltas) == final
        if sample.well_formed:
            assert final == expected(sample)
            if not has_fragment(final.content):
                assert not any(has_fragment(d.get("content", "")) for d in deltas)


def test_stream_ids_use_prefix():
    text = hermes_call("a", "{}") + hermes_call("b", "{}")
    deltas, final = stream(text, HERMES, piece_sizes(4), {"id_prefix": "chatcmpl-7-"})
    assert [c.id for c in final.tool_calls] == ["chatcmpl-7-0", "chatcmpl-7-1"]
    whole = parse_output(text, HERMES, partial=False, id_prefix="chatcmpl-7-")
    assert whole == final


def test_stream_name_first_then_arguments():
    text = hermes_call("get_weather", '{"city": "Paris", "days": 3}')
    s = ChatStream(HERMES)
    seen = []
    for ch in text:
        seen += s.feed(ch)
    first = next(d for d in seen if "tool_calls" in d)["tool_calls"][0]
    assert first["function"]["name"] == "get_weather" and first["index"] == 0
    assert first["function"]["arguments"] == "{"
    growth = [d["tool_calls"][0]["function"]["arguments"] for d in seen if "tool_calls" in d][1:]
    assert len(growth) > 5  # arguments stream as they are written


def test_stream_an_xml_string_value_as_it_is_written():
    """A Qwen XML parameter the schema types as a string streams as it is written, as
    llama-server's does; a value of another type (``days``) only once it is whole."""
    text = xml_call("get_weather", city="Saint\n\"Malo\"", days="12") + "\n"
    s = ChatStream(QWEN_XML, tool_schemas=WEATHER)
    sent_before_close = ""
    for ch in text:
        for d in s.feed(ch):
            for tc in d.get("tool_calls", []):
                if "</parameter>" not in s.text.split("<parameter=city>")[-1]:
                    sent_before_close += tc["function"]["arguments"]
    assert sent_before_close == '{"city": "Saint\\n\\"Malo\\"'  # all of it but the closing quote
    tail, final = s.finish()
    assert final.tool_calls[0].arguments == '{"city": "Saint\\n\\"Malo\\"", "days": 12}'
    cut = parse_output(text.split("\n12")[0] + "\n1", QWEN_XML, partial=True, tool_schemas=WEATHER)
    assert cut.tool_calls[0].arguments == '{"city": "Saint\\n\\"Malo\\""'  # days may still grow


def test_stream_truncated_call_keeps_what_was_sent():
    """An answer that stops inside a call: the call already announced stays, and the stream's
    final message is still what its deltas add up to."""
    text = '<tool_call>\n{"name": "a", "arguments": {"x": 1'
    deltas, final = stream(text, HERMES, piece_sizes(1), {})
    assert reassemble(deltas) == final
    assert [c.name for c in final.tool_calls] == ["a"]


TWO_CALLS_AND_A_CUT = {  # the second call cut by max_tokens inside its arguments
    HERMES: (hermes_call("a", '{"x": 1}') + '\n<tool_call>\n{"name": "b", "arguments": {"pattern": "VAL',
             [("a", '{"x": 1}'), ("b", '{"pattern": "VAL')]),
    QWEN_CODER: (xml_call("a", x="1") + "\n<tool_call>\n<function=b>\n<parameter=n>\n2\n</parameter>\n<param",
                 [("a", '{"x": 1}'), ("b", '{"n": 2')]),
    MISTRAL: ('[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"pattern": "VAL',
              [("a", '{"x": 1}'), ("b", '{"pattern": "VAL')]),
    DEEPSEEK: (DS_BEGIN + ds_call("a", '{"x": 1}') + ds_call("b", '{"pattern": "VAL').split("\n```<")[0],
               [("a", '{"x": 1}'), ("b", '{"pattern": "VAL')]),
}


@pytest.mark.parametrize("sample", [s for s in SAMPLES if s.well_formed and s.calls], ids=lambda s: s.id)
def test_an_answer_cut_anywhere_streams_what_its_whole_parse_says(sample):
    """``max_tokens`` may cut an answer at any character: streamed, the message its deltas add
    up to is the whole parse of what was written — the calls so far included."""
    for cut in range(len(sample.text) + 1):
        text = sample.text[:cut]
        deltas, final = stream(text, sample.fmt, piece_sizes(3), sample.opts)
        assert final == parse_output(text, sample.fmt, partial=False, **sample.opts), (cut, text)


@pytest.mark.parametrize("sample", [s for s in SAMPLES if s.well_formed and s.calls], ids=lambda s: s.id)
def test_an_answer_with_calls_is_read_once(sample):
    """Only a whole parse that met a block it could not read (cut, or no call, as a JSON
    answer) is read again as cut: a second parse of every answer with a call would cost its
    time on the event loop."""
    opts = ParseOptions(sample.fmt, **sample.opts)
    msg, unparsed = chat_parse._parse(sample.text, opts, False, Memo())
    assert not unparsed and msg == expected(sample)


@pytest.mark.parametrize("fmt", list(TWO_CALLS_AND_A_CUT), ids=lambda f: f.tools.value)
def test_a_call_cut_by_the_end_of_the_text_is_the_call_so_far(fmt):
    """As llama-server's lenient final parse: an answer cut inside a call (``max_tokens``)
    reports it with the arguments written so far, whole or streamed, and no markup as
    content; the stream's final message is the whole parse."""
    text, calls = TWO_CALLS_AND_A_CUT[fmt]
    whole = parse_output("Calling.\n" + text, fmt, partial=False)
    assert [(c.name, c.arguments) for c in whole.tool_calls] == calls
    assert whole.content in ("Calling.", "Calling.\n")  # what the format keeps before a call
    deltas, final = stream("Calling.\n" + text, fmt, piece_sizes(3), {})
    assert reassemble(deltas) == final == whole


def test_partial_holds_back_marker_prefixes():
    for cut in ("Hi <", "Hi <tool", "Hi <tool_call"):
        assert parse_output(cut, HERMES, partial=True).content == "Hi"
        assert parse_output(cut, HERMES, partial=False).content == cut
    assert parse_output("Done [TOOL_", MISTRAL, partial=True).content == "Done"
    assert parse_output("<thi", QWEN3, partial=True) == ChatMessage()
    assert parse_output("<thi", QWEN3, partial=False).content == "<thi"
    assert parse_output('{"na', LLAMA3, partial=True) == ChatMessage()
    assert parse_output("ok\n</thi", QWEN3, partial=True, in_reasoning=True).reasoning_content == "ok"


def test_long_plain_content_streams_exactly():
    """~50k feeds of a ~200 KB answer (its per-token cost is the constrained bench's event-loop
    figure, tools/bench/constrained.py)."""
    words = "The quick brown fox jumps over the lazy dog; a < b and [x] {y}. "
    text = words * 3000  # ~200 KB
    s = ChatStream(QWEN_XML, in_reasoning=False)
    sent = []
    for i in range(0, len(text), 4):
        sent += s.feed(text[i:i + 4])
    deltas, final = s.finish()
    assert final.content == text


@pytest.mark.parametrize("fmt,text", [
    (HERMES, hermes_call("f", json.dumps({f"k{i}": [i, "v" * 5, {"z": None}] for i in range(1500)}))),
    (HERMES, hermes_call("run", json.dumps({"code": "def f(x):\n    return x < 3 and {'a': [1]}\n" * 1500}))),
    (QWEN_CODER, xml_call("run", code="if a < b:\n    print({'x': [1]})\n" * 1500, n="1")),
    (GENERIC, json.dumps({"response": "Déjà vu \U0001F600 <tool_call> {x}\n" * 2000})),
])
def test_long_calls_stream_exactly(fmt, text):
    """Long arguments or answers, some 15k feeds each: the stream resumes its scans and still
    ends exactly where a whole parse does."""
    s = ChatStream(fmt)
    deltas = []
    for i in range(0, len(text), 4):
        deltas += s.feed(text[i:i + 4])
    tail, final = s.finish()
    assert reassemble(deltas + tail) == final == parse_output(text, fmt, partial=False)


# ---------------------------------------------------------------------------------------------
# Property: answers written from random messages parse back, whole and streamed


_WORD = st.text(alphabet="abc é<>{}[]\"\\/:;,.=_-\n", min_size=1, max_size=12)
_PROSE = st.lists(_WORD, max_size=6).map(lambda ws: " ".join(ws).strip())
_KEY = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
_SCALAR = st.one_of(st.integers(-10**6, 10**6), st.booleans(), st.none(),
                    st.floats(allow_nan=False, allow_infinity=False, width=32), _PROSE)
_JSON = st.recursive(_SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(_KEY, inner, max_size=3)), max_leaves=6)
_ARGS = st.dictionaries(_KEY, _JSON, max_size=4)
_CALLS = st.lists(st.tuples(_KEY, _ARGS), max_size=3)


def _clean(text: str, fmt: ChatFormat) -> str:
    """Prose that cannot be mistaken for structure in ``fmt``."""
    for mk in fmt.call_markers + THINK + ("<tool_call>",):
        text = text.replace(mk, "")
    text = text.strip()
    if fmt.tools in (ToolFormat.LLAMA3, ToolFormat.GENERIC):
        text = text.lstrip("{ \n")
    return text


def _xml_value(v) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def _xml_schema(calls) -> dict:
    """String parameters typed as strings, so that "12" stays text."""
    schemas: dict = {}
    for name, args in calls:
        props = schemas.setdefault(name, {"properties": {}})["properties"]
        for k, v in args.items():
            props.setdefault(k, {"type": "string" if isinstance(v, str) else "object"})
    return schemas


def write_answer(fmt: ChatFormat, reasoning: str, content: str, calls, indent) -> tuple[str, list[str]]:
    """The text a model of ``fmt`` writes for this message, and the arguments it expects back."""
    head = f"<think>\n{reasoning}\n</think>\n\n" if fmt.think_open else ""
    raw = [json.dumps(a, ensure_ascii=False, indent=indent) for _n, a in calls]
    if fmt.tools is ToolFormat.QWEN_XML:
        body = "\n".join(xml_call(n, **{k: _xml_value(v) for k, v in a.items()}) for n, a in calls)
        return head + content + ("\n\n" if content and calls else "") + body, [
            json.dumps(a, ensure_ascii=False) for _n, a in calls]
    if fmt.tools is ToolFormat.HERMES:
        body = "\n".join(hermes_call(n, r) for (n, _a), r in zip(calls, raw))
    elif fmt.tools is ToolFormat.MISTRAL_NEMO:
        items = ", ".join(f'{{"name": "{n}", "arguments": {r}}}' for (n, _a), r in zip(calls, raw))
        body = f"[TOOL_CALLS][{items}]" if calls else ""
    elif fmt.tools is ToolFormat.DEEPSEEK_R1:
        body = DS_BEGIN + "\n".join(ds_call(n, r) for (n, _a), r in zip(calls, raw)) + DS_END if calls else ""
    elif fmt.tools is ToolFormat.LLAMA3:  # calls or text, not both
        body = ";\n".join(f'{{"name": "{n}", "parameters": {r}}}' for (n, _a), r in zip(calls, raw))
        return (body if calls else content), raw
    elif fmt.tools is ToolFormat.GENERIC:
        items = ", ".join(f'{{"name": "{n}", "arguments": {r}}}' for (n, _a), r in zip(calls, raw))
        return (f'{{"tool_calls": [{items}]}}' if calls else json.dumps({"response": content})), raw
    else:
        raise AssertionError(fmt)
    return head + content + ("\n" if content and calls else "") + body, raw


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from([QWEN_XML, QWEN3, HERMES, MISTRAL, DEEPSEEK, LLAMA3, GENERIC]), reasoning=_PROSE,
       content=_PROSE,
       calls=_CALLS, indent=st.sampled_from([None, 2]), seed=st.integers(0, 2**16))
def test_written_answers_parse_back(fmt, reasoning, content, calls, indent, seed):
    reasoning = _clean(reasoning, fmt) if fmt.think_open else ""
    content = _clean(content, fmt)
    if fmt.tools in (ToolFormat.LLAMA3, ToolFormat.GENERIC) and calls:
        content = ""
    text, raw = write_answer(fmt, reasoning, content, calls, indent)
    opts = {"tool_schemas": _xml_schema(calls)} if fmt.tools is ToolFormat.QWEN_XML else {}
    want = ChatMessage(content, reasoning,
                       [ToolCall(n, r, f"call_{i}") for i, ((n, _a), r) in enumerate(zip(calls, raw))])
    final = parse_output(text, fmt, partial=False, **opts)
    assert final == want
    for cut in random.Random(seed).sample(range(len(text) + 1), min(40, len(text) + 1)):
        assert_prefix_view(parse_output(text[:cut], fmt, partial=True, **opts), final)
    deltas, streamed = stream(text, fmt, piece_sizes("random", seed), opts)
    assert reassemble(deltas) == streamed == final


# ---------------------------------------------------------------------------------------------
# The test templates: rendered as the server renders them, and read back by the parser


def render(name: str, **kw) -> str:
    jinja2 = pytest.importorskip("jinja2")
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    return env.from_string((TEMPLATES / name).read_text()).render(**kw)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": WEATHER["get_weather"]}}]
HISTORY_CALLS = [
    {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}},
    {"id": "c1", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Lyon", "hours": [9, 12]}}},
]


def conversation(args_as_text: bool = False) -> list[dict]:
    calls = json.loads(json.dumps(HISTORY_CALLS))
    if args_as_text:
        for c in calls:
            c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "Two cities.", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"}]


def assistant_turn(prompt: str) -> str:
    return prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]


def test_qwen35_template_renders_and_parses_back():
    prompt = render("qwen35_xml.jinja", messages=conversation(), tools=TOOLS, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nBe brief.")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert generation_opens_reasoning(prompt, QWEN_XML)
    msg = parse_output(assistant_turn(prompt), QWEN_XML, partial=False, tool_schemas=WEATHER)
    assert (msg.content, msg.reasoning_content) == ("Checking.", "Two cities.")
    assert [json.loads(c.arguments) for c in msg.tool_calls] == [c["function"]["arguments"] for c in HISTORY_CALLS]
    off = render("qwen35_xml.jinja", messages=conversation()[:2], add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not generation_opens_reasoning(off, QWEN_XML)


def test_hermes_template_renders_and_parses_back():
    prompt = render("hermes.jinja", messages=conversation(args_as_text=True), tools=TOOLS, add_generation_prompt=True)
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in prompt
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert not generation_opens_reasoning(prompt, HERMES)
    msg = parse_output(assistant_turn(prompt), HERMES, partial=False)
    assert msg.content == "Checking." and msg.reasoning_content == ""
    assert [json.loads(c.arguments) for c in msg.tool_calls] == [c["function"]["arguments"] for c in HISTORY_CALLS]
    mapped = render("hermes.jinja", messages=conversation(), tools=TOOLS, add_generation_prompt=True)
    assert mapped == prompt  # arguments given as a mapping render the same


_SOUP = st.lists(st.sampled_from([
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<function=f>", "<parameter=p>", "</parameter>",
    "</function>", "[TOOL_CALLS]", "<|python_tag|>", DS_BEGIN, DS_END, "<｜tool▁call▁begin｜>",
    "function<｜tool▁sep｜>", "```json", "```", "<｜tool▁call▁end｜>", '{"name": "f"', '"arguments": ',
    '"parameters": ', '"tool_call": ', '"tool_calls": [', '"response": "', '"id": "x1"', "{", "}", "[", "]",
    ",", ":", ";", '"', "\\", "\n", " ", "a", "1", "<", "\\u00e9", "\\ud83d",
]), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_SOUP, fmt=st.sampled_from([QWEN_XML, QWEN_CODER, QWEN3, HERMES, LLAMA3, MISTRAL, DEEPSEEK, GENERIC]),
       in_reasoning=st.booleans(), seed=st.integers(0, 2**16))
def test_any_text_parses_and_streams_consistently(text, fmt, in_reasoning, seed):
    """Whatever the model writes: no exception, and the stream's message is its deltas' sum."""
    opts = {"in_reasoning": in_reasoning}
    parse_output(text, fmt, partial=False, **opts)
    for cut in range(len(text) + 1):
        parse_output(text[:cut], fmt, partial=True, **opts)
    deltas, final = stream(text, fmt, piece_sizes("random", seed), opts)
    assert reassemble(deltas) == final
    for call in final.tool_calls:
        assert call.name and call.id
