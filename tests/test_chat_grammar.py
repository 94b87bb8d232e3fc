"""Grammars from JSON schemas and tool definitions: bounds, errors, and real forced calls."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

import llama_cpp.llama_cpp as L

from engine.chat.grammar import response_format_grammar, schema_to_gbnf
from engine.chat.tool_grammar import (
    DS_BEGIN, DS_CALL, DS_CALL_END, DS_END, DS_SEP, FORMATS, tool_call_grammar, validate_tools,
)

from engine.llama_backend import BatchItem, LoadedModel, make_sampler
from engine.llama_backend.grammar_sampler import _allowed_alone, check_grammar, check_grammar_spec
from engine.sampling import SamplerParams, grammar_nesting

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer"},
    "note": {"type": "string", "maxLength": 6}, "metric": {"type": "boolean"}}, "required": ["city", "days"]}
TOOLS = validate_tools([
    {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping"}},
])


@pytest.fixture(scope="module")
def model(tiny_model_path: str) -> Iterator[LoadedModel]:
    m = LoadedModel(tiny_model_path, n_ctx=2048, n_seq_max=1, n_batch=512, n_threads=1)
    yield m
    m.close()


def generate(m: LoadedModel, params: SamplerParams, n: int = 400) -> str:
    m.clear_all()
    toks = m.tokenize("Call a tool.")
    s = make_sampler(params, m)
    m.decode([BatchItem(0, toks, 0, True)])
    pos, out = len(toks), []
    try:
        for _ in range(n):
            tok = s.sample(m, 0)
            if m.is_eog(tok):
                return m.detokenize(out).decode()
            out.append(tok)
            m.decode([BatchItem(0, [tok], pos, True)])
            pos += 1
    finally:
        s.free()
    raise AssertionError(f"no end of generation after {n} tokens: {m.detokenize(out)!r}")


def extract(fmt: str, text: str) -> list[tuple[str, dict]]:
    """(name, arguments) of each call; asserts the format's framing."""
    if fmt == "QWEN_XML":
        calls = re.fullmatch(r"(<tool_call>\n<function=[^>]+>\n(?:<parameter=[^>]+>\n[\s\S]*?\n</parameter>\n)*"
                             r"</function>\n</tool_call>\n?)+", text)
        assert calls, text
        out = []
        for name, body in re.findall(r"<function=([^>]+)>\n([\s\S]*?)</function>", text):
            args = {}
            for p, v in re.findall(r"<parameter=([^>]+)>\n([\s\S]*?)\n</parameter>\n", body):
                ptype = WEATHER["properties"][p]["type"]
                args[p] = v if ptype == "string" else json.loads(v)
            out.append((name, args))
        return out
    if fmt == "HERMES":
        bodies = re.findall(r"<tool_call>\n([\s\S]*?)\n</tool_call>", text)
        assert bodies and "".join(f"<tool_call>\n{b}\n</tool_call>" for b in bodies) == text.replace(
            "</tool_call>\n<tool_call>", "</tool_call><tool_call>"), text
        return [(o["name"], o["arguments"]) for o in map(json.loads, bodies)]
    if fmt == "LLAMA3":
        o = json.loads(text)
        return [(o["name"], o["parameters"])]
    if fmt == "MISTRAL_NEMO":
        assert text.startswith("[TOOL_CALLS]"), text
        calls = json.loads(text[len("[TOOL_CALLS]"):])
        assert all(re.fullmatch(r"[a-zA-Z0-9]{9}", c["id"]) for c in calls)
        return [(c["name"], c["arguments"]) for c in calls]
    if fmt == "DEEPSEEK_R1":
        assert text.startswith(DS_BEGIN) and text.endswith(DS_END), text
        pat = re.escape(DS_CALL) + "function" + re.escape(DS_SEP) + r"([^\n]+)\n```json\n([\s\S]*?)\n```" + re.escape(DS_CALL_END)
        return [(n, json.loads(a)) for n, a in re.findall(pat, text)]
    o = json.loads(text)
    calls = o["tool_calls"] if "tool_calls" in o else [o["tool_call"]]
    return [(c["name"], c["arguments"]) for c in calls]


def check_call(name: str, args: dict) -> None:
    if name == "ping":
        assert args == {}
        return
    assert name == "get_weather" and {"city", "days"} <= set(args) <= set(WEATHER["properties"])
    assert args["city"] in ("Paris", "Oslo") and type(args["days"]) is int
    assert isinstance(args.get("note", ""), str) and len(args.get("note", "")) <= 6
    assert isinstance(args.get("metric", True), bool)


SAMPLING = [SamplerParams(temperature=0.0)] + [
    SamplerParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=s) for s in (11, 12, 13)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("parallel", [False, True])
def test_forced_calls_are_well_formed(model: LoadedModel, fmt: str, parallel: bool) -> None:
    for named in (None, "get_weather"):
        spec = tool_call_grammar(fmt, TOOLS, parallel=parallel, force=True, named=named)
        assert not spec.lazy
        check_grammar_spec(spec)
        # a gibberish model may repeat calls forever: favour the end token where the grammar allows it
        closers = [t for t in range(model.n_vocab) if model.token_to_piece(t) == b"]"]
        bias = tuple((t, 10.0) for t in [model.eos, *closers]) if parallel else ()
        for p in SAMPLING:
            text = generate(model, SamplerParams(**{**p.__dict__, "grammar": spec, "logit_bias": bias}))
            calls = extract(fmt, text)
            assert calls and (parallel or len(calls) == 1), text
            for name, args in calls:
                assert named is None or name == named
                check_call(name, args)


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_grammars_compile(fmt: str) -> None:
    for parallel in (False, True):
        spec = tool_call_grammar(fmt, TOOLS, parallel=parallel, force=False, named=None)
        check_grammar_spec(spec)
        assert spec.lazy == (fmt != "GENERIC") and bool(spec.trigger_patterns) == spec.lazy


def test_generic_auto_may_answer_in_text(model: LoadedModel) -> None:
    spec = tool_call_grammar("GENERIC", TOOLS, parallel=False, force=False, named=None)
    assert 'response' in spec.text and not spec.lazy
    check_grammar(spec.text)


@pytest.mark.parametrize("tools,why", [
    ({}, "tools must be an array"), ([1], r"tools\[0\] must be an object"),
    ([{"type": "x", "function": {"name": "a"}}], r"tools\[0\].type"),
    ([{"type": "function"}], r"tools\[0\].function must be"),
    ([{"type": "function", "function": {"name": ""}}], r"tools\[0\].function.name"),
    ([{"type": "function", "function": {"name": 3}}], r"tools\[0\].function.name"),
    ([{"type": "function", "function": {"name": "a b"}}], r"must match"),
    ([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}],
     r"tools\[1\].function.name 'a' is a duplicate"),
    ([{"type": "function", "function": {"name": "a", "parameters": []}}], r"tools\[0\].function.parameters"),
    ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)], "more than 128"),
])
def test_validate_tools_errors(tools: object, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        validate_tools(tools)


def test_named_tool_must_exist() -> None:
    with pytest.raises(ValueError, match="nope"):
        tool_call_grammar("HERMES", TOOLS, parallel=False, force=False, named="nope")


def test_schema_bounds() -> None:
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="deeper than 32"):
        schema_to_gbnf(deep)
    with pytest.raises(ValueError, match="larger than"):
        schema_to_gbnf({"type": "object", "description": "x" * 70000})
    with pytest.raises(ValueError, match="not a local reference"):
        schema_to_gbnf({"$ref": "https://example.com/s.json"})
    with pytest.raises(ValueError, match="grammar for this schema is larger"):
        schema_to_gbnf({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}, max_bytes=2000)
    with pytest.raises(ValueError, match="unsupported JSON schema"):
        schema_to_gbnf({"type": "frobnicate"})
    with pytest.raises(ValueError):
        schema_to_gbnf([])  # type: ignore[arg-type]


@pytest.mark.parametrize("schema", [
    {"type": "object"}, {}, {"type": "string", "maxLength": 5000}, {"type": "array", "items": {}, "maxItems": 500},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"type": "integer"}}},
    {"type": "object", "properties": {"x": {"description": "anything"}}, "additionalProperties": True},
    {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "^[a-z]{3}$"}]},
])
def test_schema_grammars_compile(schema: dict) -> None:
    check_grammar(schema_to_gbnf(schema))


def test_response_format() -> None:
    assert response_format_grammar({"type": "text"}) is None
    spec = response_format_grammar({"type": "json_object"})
    assert spec is not None and spec.text == schema_to_gbnf({"type": "object"})
    spec = response_format_grammar({"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}})
    assert spec is not None and spec.text == schema_to_gbnf(WEATHER)
    for bad in ({"type": "xml"}, "json", {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 1}}):
        with pytest.raises(ValueError):
            response_format_grammar(bad)


# ---- integer bounds -------------------------------------------------------------------------
def accepts(m: LoadedModel, grammar: str, text: str, root: str = "root") -> bool:
    """Whether llama.cpp's grammar sampler lets ``text`` be generated, then end: each token must
    pass the one-token apply the sampler uses, and then so must the end-of-generation token."""
    g = L.llama_sampler_init_grammar(m._voc(), grammar.encode(), root.encode())
    assert g, grammar
    try:
        for tok in m.tokenize(text, add_special=False, parse_special=False):
            if not _allowed_alone(g, tok):
                return False
            L.llama_sampler_accept(g, tok)
        return _allowed_alone(g, m.eos)
    finally:
        L.llama_sampler_free(g)


BIG = 10 ** 16 - 1  # the unbounded integer rule allows 16 digits; bounded ones the same
INT_CASES = [  # schema bounds, the inclusive range they mean
    ({"minimum": 1, "maximum": 7}, 1, 7),
    ({"minimum": 0}, 0, BIG), ({"minimum": 5}, 5, BIG), ({"minimum": 105}, 105, BIG),
    ({"minimum": 25}, 25, BIG), ({"minimum": -5}, -5, BIG), ({"minimum": -123}, -123, BIG),
    ({"maximum": 30}, -BIG, 30), ({"maximum": 0}, -BIG, 0), ({"maximum": -1}, -BIG, -1),
    ({"maximum": -105}, -BIG, -105),
    ({"minimum": -20, "maximum": -3}, -20, -3), ({"minimum": -15, "maximum": 125}, -15, 125),
    ({"minimum": 95, "maximum": 1010}, 95, 1010), ({"minimum": 0, "maximum": 0}, 0, 0),
    ({"exclusiveMinimum": 0}, 1, BIG), ({"exclusiveMaximum": 10}, -BIG, 9),
    ({"exclusiveMinimum": -3, "exclusiveMaximum": 3}, -2, 2),
    ({"minimum": 1.5, "maximum": 7.5}, 2, 7), ({"exclusiveMinimum": 1.5, "exclusiveMaximum": 7.5}, 2, 7),
    ({"minimum": 0, "exclusiveMinimum": 2}, 3, BIG),  # both: the tighter holds
    ({"minimum": 1, "exclusiveMinimum": True, "maximum": 7, "exclusiveMaximum": True}, 2, 6),  # draft 4
    ({"minimum": 1, "exclusiveMinimum": False, "maximum": 7, "exclusiveMaximum": False}, 1, 7),
    ({"exclusiveMinimum": True}, -BIG, BIG),  # draft 4 without minimum: no bound
    ({"minimum": 999_999_999_999_990}, 999_999_999_999_990, BIG),
    ({"minimum": -10 ** 20, "maximum": 10 ** 20}, -BIG, BIG),
    ({"minimum": BIG - 20}, BIG - 20, BIG), ({"maximum": -BIG + 20}, -BIG, -BIG + 20),
]


@pytest.mark.parametrize("bounds,lo,hi", INT_CASES, ids=lambda v: json.dumps(v) if isinstance(v, dict) else "")
def test_integer_bounds_accept_exactly_the_range(model: LoadedModel, bounds: dict, lo: int, hi: int) -> None:
    grammar = schema_to_gbnf({"type": "integer", **bounds})
    check_grammar(grammar)
    assert len(grammar) < 2000 and grammar_nesting(grammar) <= 20, grammar
    window: set[int] = {0, 1, -1, 10 ** 15, -(10 ** 15), -6289812836362836, BIG, -BIG, BIG + 1, -BIG - 1}
    for edge in {lo, hi} - {BIG, -BIG} or {0}:
        window.update(range(edge - 25, edge + 26))
    for v in sorted(window):
        assert accepts(model, grammar, str(v)) == (lo <= v <= hi), (v, grammar)
    assert accepts(model, grammar, str(lo)) and accepts(model, grammar, str(hi))
    for bad in ("-0", "00", "01", "-01", "+1", "1.0", "1e2", "", "-"):
        assert not accepts(model, grammar, bad), (bad, grammar)


def test_integer_bounds_in_unions_and_errors(model: LoadedModel) -> None:
    g = schema_to_gbnf({"type": ["integer", "null"], "minimum": 1, "maximum": 7})
    assert [accepts(model, g, t) for t in ("null", "1", "7", "0", "8")] == [True, True, True, False, False]
    g = schema_to_gbnf({"type": "object", "properties": {"n": {"type": "integer", "maximum": -2}}, "required": ["n"]})
    assert accepts(model, g, '{"n": -2}') and not accepts(model, g, '{"n": -1}')
    # numbers keep llama.cpp's behaviour: their bounds are not enforced
    assert accepts(model, schema_to_gbnf({"type": "number", "minimum": 1, "maximum": 7}), "1000")
    for bad in ({"minimum": 5, "maximum": 4}, {"exclusiveMinimum": 3, "exclusiveMaximum": 4}, {"minimum": BIG + 1},
                {"minimum": "1"}, {"exclusiveMaximum": "x"}, {"maximum": None}):
        with pytest.raises(ValueError):
            schema_to_gbnf({"type": "integer", **bad})


@pytest.mark.parametrize("fmt", ["QWEN_XML", "HERMES"])
def test_tool_call_integer_bounds(model: LoadedModel, fmt: str) -> None:
    params = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 7},
                                               "k": {"type": "integer", "exclusiveMaximum": -100}},
              "required": ["n", "k"]}
    tools = validate_tools([{"type": "function", "function": {"name": "f", "parameters": params}}])
    spec = tool_call_grammar(fmt, tools, parallel=False, force=True, named=None)
    check_grammar_spec(spec)
    for p in SAMPLING:
        text = generate(model, SamplerParams(**{**p.__dict__, "grammar": spec}))
        if fmt == "QWEN_XML":
            args = {k: json.loads(v) for k, v in re.findall(r"<parameter=(\w+)>\n([\s\S]*?)\n</parameter>", text)}
        else:
            args = json.loads(text.split("\n")[1])["arguments"]
        assert type(args["n"]) is int and 1 <= args["n"] <= 7, text
        assert type(args["k"]) is int and args["k"] <= -101, text
