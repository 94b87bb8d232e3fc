"""Tool-call blocks, one parser per format.

A block parser reads the calls that start at a marker the caller found (``<tool_call>``,
``[TOOL_CALLS]``, ...) and says how far they go. It runs on whole answers (``partial`` False:
the text is all there is) and on prefixes of answers still being generated (``partial`` True:
text ending inside a block means "wait", never "broken"). The views it gives of a growing
prefix only ever grow: a call is reported once its name is complete, with arguments that are
a prefix of the final arguments.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from json.encoder import encode_basestring  # json.dumps' escaping of a str (ensure_ascii=False)

from . import parse_json as pj
from .formats import ToolFormat


@dataclass
class RawCall:
    """A call as written: ``arguments`` is JSON object text; ``id`` is the model's, if any."""

    name: str
    arguments: str
    id: str | None = None


@dataclass
class Block:
    """What a block parser read at a marker.

    ``calls`` are complete. ``pending`` (partial text only) is the call still being written,
    once its name is known. ``end`` is the index after the block, None when the text ends
    inside it. ``bad_at`` is where text that cannot be a call starts: it is content from there.
    """

    calls: list[RawCall] = field(default_factory=list)
    pending: RawCall | None = None
    end: int | None = None
    bad_at: int | None = None


@dataclass
class Ctx:
    """What every block parser needs besides the text."""

    partial: bool
    memo: pj.Memo
    schemas: dict[str, dict]
    ended: bool = False  # partial text that will not grow: a call needs no more to be shown
    unparsed: bool = False  # set by a whole parse that met a block it could not read


def lit(text: str, k: int, s: str) -> int:
    """Index after the literal ``s`` at ``k``. Incomplete when the text ends inside it."""
    if text.startswith(s, k):
        return k + len(s)
    if _cut_off(text, k, s):
        raise pj.Incomplete
    raise pj.JsonError(f"expected {s!r}")


def _cut_off(text: str, k: int, s: str) -> bool:
    """The text ends inside ``s`` (or right at ``k``)."""
    return len(text) - k < len(s) and s.startswith(text[k:])


def held_back(text: str, start: int, markers: tuple[str, ...]) -> int:
    """Where the longest tail of ``text[start:]`` that is a proper prefix of a marker begins
    (``len(text)`` when there is none): that tail must not be shown yet."""
    n = len(text)
    cut = n
    for mk in markers:
        i = text.find(mk[0], max(start, n - len(mk) + 1))
        while 0 <= i < cut:
            if mk.startswith(text[i:]):
                cut = i
                break
            i = text.find(mk[0], i + 1)
    return cut


def closer(text: str, k: int, s: str, ctx: Ctx) -> int | None:
    """Index after an optional closing tag ``s`` at ``k``. A missing tag ends the block at
    ``k`` and a cut-off one at the end of the text (llama-server is as lenient); None when
    partial text may still be writing it."""
    if text.startswith(s, k):
        return k + len(s)
    if _cut_off(text, k, s):
        return None if ctx.partial else len(text)
    return k


def json_call(text: str, j: int, ctx: Ctx, *, model_id: bool = False) -> tuple[RawCall | None, int | None, bool]:
    """The call written as the JSON object at ``text[j] == '{'``: ``{"name": ..., "arguments"
    (or "parameters"): {...}}``. Returns (call, end, bad): a complete call with the object's
    end; or, on partial text, the call so far (None until its name is complete and its
    arguments have begun) with end None; or bad True when the object can never be a call.

    With ``model_id`` the object's ``"id"`` is the call's, and partial text shows the call only
    once that id is known (or the object is complete without one): an id, once streamed, cannot
    change. Without it any ``"id"`` is ignored, since it may come after the name was sent."""
    key = ("json_call", j, model_id)
    done = ctx.memo.results.get(key)
    if done is None:
        done = _json_call(text, j, ctx, model_id)
        if done[1] is not None or done[2]:  # complete or bad: settled whatever follows
            ctx.memo.results[key] = done
    return done  # type: ignore[return-value]


def _json_call(text: str, j: int, ctx: Ctx, model_id: bool) -> tuple[RawCall | None, int | None, bool]:
    try:
        scan = pj.scan_object(text, j, ctx.memo)
    except pj.JsonError:
        return None, None, True
    name = _complete_value(text, scan.get("name"))
    args = scan.get("arguments") or scan.get("parameters")
    if (name is not None and not isinstance(name, str)) or (args is not None and text[args.start] != "{"):
        return None, None, True
    call_id = _complete_value(text, scan.get("id")) if model_id else None
    call_id = call_id if isinstance(call_id, str) and call_id else None
    if scan.end is not None:
        if not name or args is None or not isinstance(ctx.memo.loads(text, j, scan.end), dict):
            return None, None, True
        raw = text[args.start:args.end]
        if not isinstance(ctx.memo.loads(text, args.start, args.end), dict):
            return None, None, True
        return RawCall(name, raw, call_id), scan.end, False
    if not ctx.partial:
        return None, None, True
    if not name or args is None or (model_id and call_id is None and not ctx.ended):
        return None, None, False
    raw = text[args.start:args.end] if args.end is not None else text[args.start:].rstrip()
    return RawCall(name, raw, call_id), None, False


def _complete_value(text: str, member: pj.Member | None) -> object:
    if member is None or member.end is None:
        return None
    return pj.loads_or_none(text[member.start:member.end])  # a name or an id: short


def object_list(text: str, j: int, ctx: Ctx, *, sep: str, close: str | None = None,
                model_id: bool = False) -> Block:
    """Calls written as JSON objects separated by ``sep`` (up to ``close`` when given), the
    first at or after ``j``. ``bad_at`` marks the first object that is not a call."""
    calls: list[RawCall] = []
    n = len(text)
    while True:
        j = pj.skip_ws(text, j)
        if j >= n:
            return Block(calls) if ctx.partial else Block(calls, end=n)
        if close and text[j] == close:
            return Block(calls, end=j + 1)
        if text[j] != "{":
            return Block(calls, bad_at=j)
        call, end, bad = json_call(text, j, ctx, model_id=model_id)
        if bad:
            return Block(calls, bad_at=j)
        if end is None:
            return Block(calls, pending=call)
        calls.append(call)
        k = pj.skip_ws(text, end)
        if k >= n:
            return Block(calls) if ctx.partial else Block(calls, end=n)
        if text[k] == sep:
            j = k + 1
        elif close and text[k] == close:
            return Block(calls, end=k + 1)
        else:
            return Block(calls, end=end)


def hermes_block(text: str, m: int, marker: str, ctx: Ctx) -> Block:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""
    j = pj.skip_ws(text, m + len(marker))
    if j >= len(text):
        return Block() if ctx.partial else Block(bad_at=m)
    if text[j] != "{":
        return Block(bad_at=m)
    call, end, bad = json_call(text, j, ctx)
    if bad:
        return Block(bad_at=m)
    if end is None:
        return Block(pending=call)
    k = closer(text, pj.skip_ws(text, end), "</tool_call>", ctx)
    return Block(pending=call) if k is None else Block([call], end=k)


def llama3_block(text: str, m: int, marker: str, ctx: Ctx) -> Block:
    """One or more ``{"name": ..., "parameters": {...}}`` separated by ``;``, after
    ``<|python_tag|>`` or (``marker`` empty) as the whole start of the answer."""
    return object_list(text, m + len(marker), ctx, sep=";")


def mistral_block(text: str, m: int, marker: str, ctx: Ctx) -> Block:
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "..."}, ...]``. A call is shown
    only once its id is known, so that the id streamed first is the model's."""
    j = pj.skip_ws(text, m + len(marker))
    if j >= len(text):
        return Block() if ctx.partial else Block(bad_at=m)
    if text[j] != "[":
        return Block(bad_at=m)
    return object_list(text, j + 1, ctx, sep=",", close="]", model_id=True)


DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_SEP = "function<｜tool▁sep｜>"


def deepseek_block(text: str, m: int, marker: str, ctx: Ctx) -> Block:
    """``<｜tool▁calls▁begin｜>`` then calls ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    \\n```json\\n{...}\\n```<｜tool▁call▁end｜>`` (the call-begin token is optional, as
    llama-server allows), then ``<｜tool▁calls▁end｜>``."""
    calls: list[RawCall] = []
    n = len(text)
    j = m + len(marker)
    while True:
        j = pj.skip_ws(text, j)
        if text.startswith(DS_CALLS_END, j):
            return Block(calls, end=j + len(DS_CALLS_END))
        if j >= n:
            return Block(calls) if ctx.partial else Block(calls, end=n)
        pending: RawCall | None = None
        try:
            k = j
            if text.startswith(DS_CALL_BEGIN, j):
                k += len(DS_CALL_BEGIN)
            elif _cut_off(text, j, DS_CALL_BEGIN) or _cut_off(text, j, DS_CALLS_END):
                raise pj.Incomplete
            k = lit(text, k, DS_SEP)
            nl = text.find("\n", k)
            if nl < 0:
                raise pj.Incomplete
            pending = RawCall(text[k:nl].strip(), "")
            if not pending.name:
                raise pj.JsonError("no name")
            k = pj.skip_ws(text, lit(text, nl + 1, "```json"))
            if k < n and text[k] != "{":
                raise pj.JsonError("arguments are not an object")
            try:
                end = pj.value_end(text, k, ctx.memo)
            except pj.Incomplete:
                pending.arguments = text[k:].rstrip()
                raise
            pending.arguments = text[k:end]
            if not isinstance(ctx.memo.loads(text, k, end), dict):
                raise pj.JsonError("bad arguments")
            k = closer(text, pj.skip_ws(text, end), "```", ctx)
            if k is not None:
                k = closer(text, pj.skip_ws(text, k), DS_CALL_END, ctx)
            if k is None:
                raise pj.Incomplete
        except pj.Incomplete:
            if ctx.partial:
                return Block(calls, pending=pending)
            return Block(calls, bad_at=j)
        except pj.JsonError:
            return Block(calls, bad_at=j)
        calls.append(pending)
        j = k


def qwen_xml_block(text: str, m: int, marker: str, ctx: Ctx) -> Block:
    """``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...
    </function>\\n</tool_call>``. Values are raw text, typed by the tool's schema; the
    arguments are re-serialized canonically (:func:`canonical_member`). A pending call shows
    the completed parameters, without the closing brace, and the value being written when the
    schema says it is a string (it streams as llama-server's does; another type, or an untyped
    value, may still change its type) or when the text has ended."""
    pending: RawCall | None = None
    try:
        k = lit(text, pj.skip_ws(text, m + len(marker)), "<function=")
        gt = text.find(">", k)
        if gt < 0:
            raise pj.Incomplete
        name = text[k:gt].strip()
        if not name or "<" in name or "\n" in name:
            raise pj.JsonError("bad function name")
        props = (ctx.schemas.get(name) or {}).get("properties") or {}
        members: list[str] = []
        pending = RawCall(name, "{")
        k = gt + 1
        while True:
            k = pj.skip_ws(text, k)
            if text.startswith("</function>", k):
                k += len("</function>")
                break
            if _cut_off(text, k, "</function>"):
                raise pj.Incomplete
            k = lit(text, k, "<parameter=")
            gt = text.find(">", k)
            if gt < 0:
                raise pj.Incomplete
            pname = text[k:gt].strip()
            close = ctx.memo.find(text, _PARAM_CLOSE, gt + 1)
            if close < 0:  # the text ends in this value
                prop = props.get(pname)
                shown = ctx.partial and (ctx.ended or _schema_types(prop) == {"string"})
                cut = _cut_member(text, pname, gt + 1, prop, ctx.memo) if shown else None
                if cut is not None:
                    pending.arguments = "{" + ", ".join([*members, cut])
                raise pj.Incomplete
            members.append(_xml_member(text, pname, gt + 1, close, props.get(pname), ctx))
            pending.arguments = "{" + ", ".join(members)
            k = close + len(_PARAM_CLOSE)
        call = RawCall(name, pending.arguments + "}")
        end = closer(text, pj.skip_ws(text, k), "</tool_call>", ctx)
        if end is None:
            return Block(pending=call)
        return Block([call], end=end)
    except pj.Incomplete:
        if ctx.partial:
            return Block(pending=pending)
        return Block(bad_at=m)
    except pj.JsonError:
        return Block(bad_at=m)


def _xml_member(text: str, pname: str, a: int, b: int, prop: dict | None, ctx: Ctx) -> str:
    """The canonical member for the parameter value ``text[a:b]``, typed once per stream."""
    key = ("xml_member", a, b, pname)
    member = ctx.memo.results.get(key)
    if member is None:
        member = ctx.memo.results[key] = canonical_member(pname, xml_value(text[a:b], prop))
    return member  # type: ignore[return-value]


def _cut_member(text: str, pname: str, a: int, prop: dict | None, memo: pj.Memo) -> str | None:
    """The member for a parameter value the text ends in (``text[a:]``, less what may be the
    start of its closing tag): a string without its closing quote, or another type's text as
    written (None while there is none). A prefix of the member the whole value gives."""
    end = held_back(text, a, (_PARAM_CLOSE,))
    start = a + 1 if text.startswith("\n", a) else a
    if end > start and text[end - 1] == "\n":  # maybe the newline before the tag, not the value's
        end -= 1
    end = max(start, end)
    types = _schema_types(prop)
    if types != {"string"} and (types is not None or _JSONISH.match(text[start:end].strip())):
        written = text[start:end].strip()  # another type: as written, once something is
        if not written:
            return None
        return json.dumps(pname, ensure_ascii=False) + ": " + written
    # A string streamed: its escaped text grows by what was written since the last parse.
    key, empty = ("xml_cut", start, pname), (start, canonical_member(pname, "")[:-1])
    upto, member = memo.results.get(key, empty)  # type: ignore[misc]
    if upto > end:  # held back more than the last parse did
        upto, member = empty
    member += encode_basestring(text[upto:end])[1:-1]
    memo.results[key] = (end, member)
    return member


def canonical_member(key: str, value: object) -> str:
    """One ``"key": value`` of the canonical arguments text: ``json.dumps`` with its default
    separators and ``ensure_ascii=False``, so that ``"{" + ", ".join(members) + "}"`` is
    exactly ``json.dumps(dict(...), ensure_ascii=False)``."""
    return json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)


def _reject_constant(name: str) -> object:
    raise ValueError(name)  # NaN and Infinity would re-serialize as invalid JSON


_PARAM_CLOSE = "</parameter>"
_JSONISH = re.compile(r"-?[0-9]|true\Z|false\Z|null\Z|[\[{]")
_PY_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,), "number": (int, float), "boolean": (bool,), "object": (dict,),
    "array": (list,), "null": (type(None),),
}


def _schema_types(prop: dict | None) -> set[str] | None:
    if not isinstance(prop, dict):
        return None
    t = prop.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    alts = prop.get("anyOf") or prop.get("oneOf")
    if isinstance(alts, list):
        types = [_schema_types(a) for a in alts]
        if all(types):
            return set().union(*types)
    return None


def xml_value(raw: str, prop: dict | None) -> object:
    """The value of one XML parameter: the raw text less one leading and one trailing newline,
    typed by the parameter's schema. A string-only parameter stays text; another type is JSON
    when it parses (text otherwise); without a schema, text that looks like a number, boolean,
    null, object or array is tried as JSON."""
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    types = _schema_types(prop)
    if types == {"string"} or (types is None and not _JSONISH.match(raw.strip())):
        return raw
    try:
        value = json.loads(raw.strip(), parse_constant=_reject_constant)
    except ValueError:
        return raw
    if types is None or "string" not in types:
        return value
    ok = any(isinstance(value, _PY_TYPES.get(t, ())) for t in types)
    if isinstance(value, bool) and not {"boolean"} & types:
        ok = False
    return value if ok else raw


BLOCK_PARSERS = {
    ToolFormat.QWEN_XML: qwen_xml_block,
    ToolFormat.HERMES: hermes_block,
    ToolFormat.LLAMA3: llama3_block,
    ToolFormat.MISTRAL_NEMO: mistral_block,
    ToolFormat.DEEPSEEK_R1: deepseek_block,
}
