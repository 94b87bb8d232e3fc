"""GBNF grammars of well-formed tool calls, per format, and for a think block first.

``tool_choice`` ``required`` (or a named function) forces a call from the first token, as
OpenAI promises a call (the pinned llama-server lets any text up to the call opener come first,
docs/http.md "Grammars"); ``auto`` makes the grammar lazy, armed by the format's call opener, as
llama-server's. Arguments are the JSON grammar of each tool's ``parameters`` (``grammar._Converter``).
"""
from __future__ import annotations

import copy
import re
from dataclasses import replace
from typing import Any

from ..sampling import GrammarSpec
from .grammar import MAX_SCHEMA_BYTES, _bounded_copy, _convert, _Converter, _finish, _new_converter, _prim, _repeat

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
FORMATS = ("QWEN_XML", "HERMES", "LLAMA3", "MISTRAL_NEMO", "DEEPSEEK_R1", "GENERIC")
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


# ---- tools ---------------------------------------------------------------------------------
def validate_tools(tools: Any) -> list[dict]:
    """OpenAI ``tools`` → ``[{"type": "function", "function": {"name", "description"?,
    "parameters"}}]`` (parameters default to an empty object schema). ``ValueError`` naming
    the index and field of the first malformed entry."""
    if not isinstance(tools, list):
        raise ValueError("tools must be an array")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools has {len(tools)} entries, more than {MAX_TOOLS}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{i}] must be an object")
        if tool.get("type") != "function":
            raise ValueError(f"tools[{i}].type must be \"function\"")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"tools[{i}].function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if not TOOL_NAME.fullmatch(name):
            raise ValueError(f"tools[{i}].function.name {name!r} must match ^[A-Za-z0-9_.-]{{1,64}}$")
        if name in seen:
            raise ValueError(f"tools[{i}].function.name {name!r} is a duplicate")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be an object")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ValueError(f"tools[{i}].function.description must be a string")
        entry: dict[str, Any] = {"name": name, "parameters": copy.deepcopy(params)}
        if desc is not None:
            entry["description"] = desc
        out.append({"type": "function", "function": entry})
    return out


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _lit(s: str) -> str:
    """A GBNF string literal for ``s``."""
    return '"' + "".join(_ESCAPES.get(c) or (f"\\x{ord(c):02X}" if ord(c) < 32 else c) for c in s) + '"'


def _call_object(conv: _Converter, name: str, params: Any, i: int, args_key: str,
                 extra: dict | None = None) -> str:
    """Rule for ``{"name": NAME, args_key: ARGS, …extra}`` (keys in this order)."""
    props = {"name": {"const": name}, args_key: params, **(extra or {})}
    schema = {"type": "object", "properties": props, "required": list(props)}
    return _convert(schema, f"call{i}", conv)


def _qwen_value(conv: _Converter, pschema: dict, rule: str) -> str:
    if isinstance(pschema, dict) and pschema.get("type") == "string" and not (
            {"$ref", "anyOf", "oneOf", "const"} & pschema.keys()):
        if isinstance(pschema.get("enum"), list) and all(isinstance(v, str) for v in pschema["enum"]):
            return conv._add_rule(rule, " | ".join(_lit(v) for v in pschema["enum"]))
        # raw text up to "\n</parameter>": no "</" and no "<" right before another "<"
        if "minLength" in pschema or "maxLength" in pschema:
            rep = _repeat(pschema, "minLength", "maxLength")
            return conv._add_rule(rule, f'( [^<] | "<" [^/<] ){rep}')
        return conv._add_rule("xml-text", '( [^<] | "<" [^/<] )*')
    return _convert(pschema, rule, conv)


def _qwen_call(conv: _Converter, name: str, params: Any, i: int) -> str:
    props = params.get("properties", {}) if isinstance(params, dict) else {}
    required = set(params.get("required", [])) if isinstance(params, dict) else set()
    parts = []
    for j, (pname, pschema) in enumerate(props.items()):
        value = _qwen_value(conv, pschema, f"call{i}-p{j}")
        part = f'{_lit(f"<parameter={pname}>" + chr(10))} {value} "\\n</parameter>\\n"'
        parts.append(part if pname in required else f"( {part} )?")
    body = " ".join(parts)
    head = _lit(f"<tool_call>\n<function={name}>\n")
    return conv._add_rule(f"call{i}", f'{head} {body} "</function>\\n</tool_call>"')


def _one_call(fmt: str, conv: _Converter, fn: dict, i: int) -> str:
    name = fn["name"]
    params = _bounded_copy(fn["parameters"], f"parameters of {name}", f"t{i}-")
    if fmt == "QWEN_XML":
        return _qwen_call(conv, name, params, i)
    if fmt == "HERMES":
        obj = _call_object(conv, name, params, i, "arguments")
        return conv._add_rule(f"tc{i}", f'"<tool_call>\\n" {obj} "\\n</tool_call>"')
    if fmt == "LLAMA3":
        return _call_object(conv, name, params, i, "parameters")
    if fmt == "MISTRAL_NEMO":
        tool_id = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
        return _call_object(conv, name, params, i, "arguments", {"id": tool_id})
    if fmt == "DEEPSEEK_R1":
        head = _lit(f"{DS_CALL}function{DS_SEP}{name}\n```json\n")
        args = _convert(params, f"call{i}-args", conv)
        return conv._add_rule(f"tc{i}", f'{head} {args} {_lit(chr(10) + "```" + DS_CALL_END)}')
    if fmt == "GENERIC":
        return _call_object(conv, name, params, i, "arguments")
    raise ValueError(f"unknown tool call format {fmt!r}")


def _trigger(opener: str) -> str:
    return r"[\s\S]*?(" + re.escape(opener) + r")[\s\S]*"


def _wrap(fmt: str, call: str, parallel: bool) -> tuple[str, tuple[str, ...]]:
    """Root rule body for one or more calls, and the trigger pattern for "auto"."""
    newline, comma = '"\\n"', '"," space'
    many = lambda sep: f"{call} ({sep} {call})*" if parallel else call  # noqa: E731
    if fmt in ("QWEN_XML", "HERMES"):
        return many(newline), (_trigger("<tool_call>"),)
    if fmt == "LLAMA3":  # one call; the model starts its answer with the JSON object
        return call, (r'^\s*(\{\s*"name")[\s\S]*$',)
    if fmt == "MISTRAL_NEMO":
        return f'"[TOOL_CALLS]" "[" {many(comma)} "]"', (_trigger("[TOOL_CALLS]"),)
    if fmt == "DEEPSEEK_R1":
        return f"{_lit(DS_BEGIN)} {many(newline)} {_lit(DS_END)}", (_trigger(DS_BEGIN),)
    raise AssertionError(fmt)


def tool_call_grammar(fmt_name: str, tools: list[dict], *, parallel: bool, force: bool,
                      named: str | None) -> GrammarSpec:
    """The grammar of well-formed tool calls in format ``fmt_name`` (a ``ToolFormat`` name).

    ``tools`` as returned by :func:`validate_tools`. ``named`` restricts the calls to that
    function and, like ``force``, makes them mandatory; otherwise ("auto") the grammar is lazy,
    triggered by the format's call opener, so the model may answer in text. GENERIC is never
    lazy: one JSON object with ``tool_call`` (``tool_calls`` when ``parallel``) or, unless
    forced, ``response``. ``parallel`` allows one or more calls, else exactly one.
    """
    if fmt_name not in FORMATS:
        raise ValueError(f"unknown tool call format {fmt_name!r}")
    fns = [t["function"] for t in tools]
    if named is not None:
        fns = [f for f in fns if f["name"] == named]
        if not fns:
            raise ValueError(f"tool_choice names function {named!r}, which is not in tools")
        force = True
    if not fns:
        raise ValueError("no tools to call")
    conv = _new_converter()
    calls = [_one_call(fmt_name, conv, fn, i) for i, fn in enumerate(fns)]
    call = conv._add_rule("tool-call", " | ".join(calls))
    if fmt_name == "GENERIC":
        root, patterns = _generic_root(conv, call, parallel, force), ()
    else:
        root, patterns = _wrap(fmt_name, call, parallel)
    conv._rules["root"] = root
    text = _finish(conv.format_grammar(), 4 * MAX_SCHEMA_BYTES)
    lazy = not force and fmt_name != "GENERIC"
    return GrammarSpec(text, "root", lazy, patterns if lazy else ())


def _generic_root(conv: _Converter, call: str, parallel: bool, force: bool) -> str:
    if parallel:
        calls = conv._add_rule("tool-calls", f'"[" space {call} ("," space {call})* "]" space')
        alt = f'"{{" space "\\"tool_calls\\"" space ":" space {calls} "}}" space'
    else:
        alt = f'"{{" space "\\"tool_call\\"" space ":" space {call} "}}" space'
    if force:
        return alt
    string = conv._add_primitive("string", _prim("string"))
    return f'{alt} | "{{" space "\\"response\\"" space ":" space {string} "}}" space'


# ---- a think block first ------------------------------------------------------------------
def after_reasoning(spec: GrammarSpec, close: str) -> GrammarSpec:
    """``spec`` for a model whose output starts inside a think block: free reasoning until
    ``close``, then ``spec``. A forced grammar becomes lazy, triggered by ``close`` (its text
    then starts with ``close`` and optional whitespace); a lazy one's triggers count only after
    ``close``, so a call opener the model merely thinks about does not arm it."""
    if spec.lazy:
        return replace(spec, trigger_patterns=tuple(_after_close(p, close) for p in spec.trigger_patterns))
    root = "after-reasoning"
    text = f"{spec.text.rstrip()}\n{root} ::= {_lit(close)} [ \\t\\n]* {spec.root}\n"
    return GrammarSpec(text, root, True, (re.escape(close),), spec.trigger_tokens)


def _after_close(pattern: str, close: str) -> str:
    if pattern.startswith("^"):  # anchored: the whole text must match
        return "^[\\s\\S]*?" + re.escape(close) + pattern[1:]
    return re.escape(close) + pattern
