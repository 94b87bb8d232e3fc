"""``-Y`` display filters: a small, safe expression language over message fields (no ``eval``).

    op == DECODE and status != OK
    stream == 3 && direction == response
    size > 1MiB or latency >= 250
    key == "0" and not hydra.v3.hdr_hash_ok
    op in {PREFILL DECODE} and trace contains "bench"
    hydra.meta.error matches "slot .* busy"      (regex, Python syntax)

Grammar (precedence low → high: ``or``, ``and``, ``not``)::

    expr   := term (("or" | "||") term)*
    term   := factor (("and" | "&&") factor)*
    factor := ("not" | "!") factor | "(" expr ")" | test
    test   := FIELD [CMP value | "in" "{" value* "}"]      FIELD alone: present and truthy
    CMP    := == != < <= > >= eq ne lt le gt ge contains matches ~
    value  := NUMBER [size unit] | "string" | 'string' | BAREWORD | true | false

Fields are any name :meth:`Message.filter_values` knows: ``op``, ``cmd``, ``status``, ``key``,
``trace``, ``stream``, ``direction`` (request/response), ``proto``, ``size``, ``payload_len``,
``latency`` (ms), ``complete``, ``notes`` and every dotted field name (``hydra.kv.n_past``).
A dict-valued field can be entered with dots (``hydra.meta.error``). A field a message does not
have makes every comparison on it false (as in Wireshark). Enum fields (op, status, cmd) compare
by name (case-insensitive) or number: ``op == DECODE`` and ``op == 0x43`` are the same test.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from .util import Named

_MISSING = object()
_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<num>0[xX][0-9a-fA-F]+|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)(?P<unit>[kKmMgGtT]i?[bB]?|[bB])?(?![\w.])
  | (?P<op>==|!=|<=|>=|<|>|&&|\|\||!|~|\(|\)|\{|\}|,)
  | (?P<word>[A-Za-z_][\w.\-]*(?:\[\d+\])?)
""", re.VERBOSE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_WORD_OPS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "contains": "contains",
             "matches": "matches", "~": "matches"}
_CMP = {"==", "!=", "<", "<=", ">", ">=", "contains", "matches"}
MAX_REGEX = 500


class FilterError(ValueError):
    """A filter that does not parse; the message points at the problem."""


@dataclass(frozen=True)
class Literal:
    value: Any
    text: str  # as written, for comparing with string fields (key == 0)


def _tokens(src: str) -> list[tuple[str, Any, int]]:
    out, pos = [], 0
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if m is None:
            raise FilterError(f"unexpected {src[pos:pos + 10]!r} at column {pos + 1}")
        kind = m.lastgroup if m.lastgroup != "unit" else "num"
        if kind == "ws":
            pos = m.end()
            continue
        if m.group("num") is not None:
            kind = "num"
        out.append((kind, m.group(0), pos))
        pos = m.end()
    out.append(("end", "", len(src)))
    return out


def _number(tok: str) -> int | float:
    m = re.fullmatch(r"(0[xX][0-9a-fA-F]+|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)([kKmMgGtT]i?[bB]?|[bB])?", tok)
    assert m is not None
    num, unit = m.group(1), (m.group(2) or "").lower()
    value: int | float = int(num, 16) if num[:2] in ("0x", "0X") else (float(num) if any(c in num for c in ".eE") else int(num))
    mult = _UNITS[unit[:1]] if unit else 1
    if unit and "i" not in unit and unit not in ("b",) and unit.endswith("b"):
        mult = {"k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}[unit[0]]  # kB = 1000, KiB = 1024
    return value * mult


def _unquote(s: str) -> str:
    body = s[1:-1]
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), body)


class _Parser:
    def __init__(self, src: str):
        self.src = src
        self.toks = _tokens(src)
        self.i = 0

    def peek(self) -> tuple[str, Any, int]:
        return self.toks[self.i]

    def take(self) -> tuple[str, Any, int]:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def at_word(self, *words: str) -> bool:
        kind, text, _ = self.peek()
        return (kind == "word" and text.lower() in words) or (kind == "op" and text in words)

    def fail(self, what: str) -> FilterError:
        kind, text, pos = self.peek()
        got = "end of filter" if kind == "end" else repr(text)
        return FilterError(f"{what} at column {pos + 1}, got {got}")

    def parse(self) -> Callable[[dict], bool]:
        node = self.expr()
        if self.peek()[0] != "end":
            raise self.fail("expected 'and', 'or' or the end")
        return node

    def expr(self) -> Callable[[dict], bool]:
        parts = [self.term()]
        while self.at_word("or", "||"):
            self.take()
            parts.append(self.term())
        return parts[0] if len(parts) == 1 else (lambda v, p=tuple(parts): any(f(v) for f in p))

    def term(self) -> Callable[[dict], bool]:
        parts = [self.factor()]
        while self.at_word("and", "&&"):
            self.take()
            parts.append(self.factor())
        return parts[0] if len(parts) == 1 else (lambda v, p=tuple(parts): all(f(v) for f in p))

    def factor(self) -> Callable[[dict], bool]:
        if self.at_word("not", "!"):
            self.take()
            inner = self.factor()
            return lambda v: not inner(v)
        if self.peek()[:2] == ("op", "("):
            self.take()
            node = self.expr()
            if self.peek()[:2] != ("op", ")"):
                raise self.fail("expected ')'")
            self.take()
            return node
        return self.test()

    def test(self) -> Callable[[dict], bool]:
        kind, name, _ = self.peek()
        if kind != "word" or name.lower() in ("and", "or", "not", "in") or name.lower() in _WORD_OPS:
            raise self.fail("expected a field name")
        self.take()
        kind, text, _ = self.peek()
        op = text if kind == "op" and text in _CMP | {"~"} else _WORD_OPS.get(text.lower()) if kind == "word" else None
        if op == "~":
            op = "matches"
        if op is None and kind == "word" and text.lower() == "in":
            self.take()
            return self._in(name)
        if op is None:
            return lambda v: _truthy(_lookup(v, name))
        self.take()
        lit = self.value()
        if op == "matches":
            if not isinstance(lit.value, str) or len(lit.value) > MAX_REGEX:
                raise FilterError(f"'matches' needs a string pattern of at most {MAX_REGEX} characters")
            try:
                rx = re.compile(lit.value)
            except re.error as e:
                raise FilterError(f"bad regular expression {lit.value!r}: {e}") from None
            return lambda v: _matches(_lookup(v, name), rx)
        return lambda v: _compare(_lookup(v, name), op, lit)

    def _in(self, name: str) -> Callable[[dict], bool]:
        if self.peek()[:2] != ("op", "{"):
            raise self.fail("expected '{' after 'in'")
        self.take()
        values = []
        while self.peek()[:2] != ("op", "}"):
            if self.peek()[0] == "end":
                raise self.fail("expected '}'")
            if self.peek()[:2] == ("op", ","):
                self.take()
                continue
            values.append(self.value())
        self.take()
        return lambda v: any(_compare(_lookup(v, name), "==", lit) for lit in values)

    def value(self) -> Literal:
        kind, text, _ = self.peek()
        if kind == "num":
            self.take()
            return Literal(_number(text), text)
        if kind == "str":
            self.take()
            s = _unquote(text)
            return Literal(s, s)
        if kind == "word":
            self.take()
            low = text.lower()
            if low in ("true", "false"):
                return Literal(low == "true", text)
            return Literal(text, text)
        raise self.fail("expected a value")


def compile_filter(src: str) -> Callable[[dict], bool]:
    """Parse ``src`` once; the result tests a ``Message.filter_values()`` dict."""
    if not src.strip():
        return lambda v: True
    return _Parser(src).parse()


def _lookup(values: dict, name: str) -> Any:
    if name in values:
        return values[name]
    # "hydra.meta.error": walk into a dict-valued field by its longest known prefix.
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:cut])
        if head in values:
            v = values[head]
            for p in parts[cut:]:
                if isinstance(v, dict) and p in v:
                    v = v[p]
                else:
                    return _MISSING
            return v
    return _MISSING


def _truthy(v: Any) -> bool:
    return v is not _MISSING and v is not None and v is not False and v != "" and v != [] and v != {}


def _as_number(v: Any) -> int | float | None:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)):
        return v
    return None


def _compare(v: Any, op: str, lit: Literal) -> bool:
    if v is _MISSING or v is None:
        return False
    want = lit.value
    if op == "contains":
        if isinstance(v, str):
            return str(want) in v
        if isinstance(v, (list, tuple)):
            return any(_compare(x, "==", lit) for x in v)
        if isinstance(v, dict):
            return str(want) in v
        return False
    if isinstance(v, Named):
        if isinstance(want, str):
            eq = v.name.lower() == want.lower()
            return eq if op == "==" else (not eq) if op == "!=" else False
        return _ordered(int(v), op, want)
    if isinstance(v, bool) or isinstance(want, bool):
        if op not in ("==", "!="):
            return False
        eq = bool(v) == bool(want) if isinstance(want, bool) else str(v).lower() == str(want).lower()
        return eq if op == "==" else not eq
    if isinstance(v, str):
        other = want if isinstance(want, str) else lit.text
        return _ordered(v, op, other) if op in ("==", "!=") else _ordered(v, op, other)
    num = _as_number(v)
    if num is not None:
        if isinstance(want, str):
            return (op == "!=") if op in ("==", "!=") else False
        return _ordered(num, op, want)
    if op in ("==", "!="):
        eq = v == want
        return eq if op == "==" else not eq
    return False


def _ordered(a: Any, op: str, b: Any) -> bool:
    try:
        if op == "==":
            return a == b
        if op == "!=":
            return a != b
        if op == "<":
            return a < b
        if op == "<=":
            return a <= b
        if op == ">":
            return a > b
        if op == ">=":
            return a >= b
    except TypeError:
        return False
    return False


def _matches(v: Any, rx: re.Pattern) -> bool:
    if v is _MISSING or v is None:
        return False
    s = v.name if isinstance(v, Named) else v if isinstance(v, str) else str(v)
    return rx.search(s) is not None
