"""``-Y`` display filters: a small, safe expression language over message fields (no ``eval``).

The user documentation is :data:`HELP` (``hydra-rpc inspect -Y help``). Like Wireshark, a filter
naming a field that does not exist, or comparing an opcode/status/direction with a value it
never has (``op == FOO``), is an error when it is compiled, not a filter that silently matches
nothing. Dotted protocol fields (``hydra.kv.n_past``) are built from the codec's layouts, so
only their protocol prefix is checked.

Grammar (precedence low → high: ``or``, ``and``, ``not``)::

    expr   := term (("or" | "||") term)*
    term   := factor (("and" | "&&") factor)*
    factor := ("not" | "!") factor | "(" expr ")" | test
    test   := FIELD [CMP value | "in" "{" value* "}"]      FIELD alone: present and truthy
    CMP    := == != < <= > >= eq ne lt le gt ge contains matches ~
    value  := NUMBER [size unit] | "string" | 'string' | BAREWORD | true | false
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from codec import ggml as G
from codec.enums import Op, Status

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


# The fields every message may have (besides the dotted protocol fields), as -Y help lists them.
FIELDS = {
    "op": "opcode (Hydra) or command (ggml-RPC): DECODE, HELLO, … or a number like 0x43; "
          "a response has its request's",
    "cmd": "ggml-RPC command: HELLO, SET_TENSOR, GRAPH_COMPUTE, … or a number",
    "status": "Hydra status: OK, NOT_FOUND, ERROR, PARTIAL, BUSY, BAD_REQUEST, NOT_IMPLEMENTED; "
              "a request has its response's",
    "key": "the request's key (slot number or Store key)",
    "trace": "the request's trace id",
    "dialect": "PREFILL/DECODE dialect: json, e1, v3, pin, json-frames",
    "error": "the error text in a reply's meta",
    "direction": "request or response",
    "proto": "hydra, ggml or raw (neither, e.g. bad magic)",
    "stream": "TCP connection number (0, 1, …)",
    "number": "the message's number in the listing",
    "frame": "capture frame holding the message's first byte",
    "src": "sender HOST:PORT",
    "dst": "receiver HOST:PORT",
    "size": "message size in bytes (units: 4k, 64KiB, 1MB)",
    "payload_len": "payload length from the header",
    "key_len": "key length from the header",
    "trace_len": "trace id length from the header",
    "meta_len": "meta length from the response header",
    "latency": "milliseconds from the request's first byte to the response's (also latency_ms)",
    "latency_ms": "same as latency",
    "complete": "true when every byte of the message was captured",
    "notes": "number of notes and warnings on the message",
    "answered": "ggml-RPC: false for commands the server does not answer",
    "data_len": "ggml-RPC SET_TENSOR: bytes of tensor data",
    "n_nodes": "ggml-RPC GRAPH_COMPUTE: graph nodes",
    "n_tensors": "ggml-RPC GRAPH_COMPUTE: tensors",
    "version": "ggml-RPC version negotiated by HELLO",
}
PROTOCOL_PREFIXES = ("hydra.", "ggml.")


def _ggml_names() -> set[str]:
    names = {c.name for c in G.Cmd}
    for fork in (None, *G.FORKS):
        names |= {info.name for info in G.command_table(None, fork).values()}
    return names


# Fields whose values are names: a bareword that is none of them is a mistake (op == FOO).
VALUES = {
    "op": {o.name for o in Op} | _ggml_names(),
    "cmd": _ggml_names(),
    "status": {s.name for s in Status},
    "direction": {"request", "response"},
    "proto": {"hydra", "ggml", "raw"},
}


def check_field(name: str) -> None:
    """Raise FilterError unless ``name`` is a field a message can have."""
    if name in FIELDS or name.startswith(PROTOCOL_PREFIXES):
        return
    raise FilterError(f"unknown field {name!r}; fields: {', '.join(FIELDS)}, and the dotted protocol fields "
                      "(hydra.…, ggml.…) that -V shows; see -Y help")


def _check_value(name: str, lit: "Literal") -> None:
    allowed = VALUES.get(name)
    if allowed is None or not isinstance(lit.value, str):
        return
    if lit.value.lower() not in {a.lower() for a in allowed}:
        raise FilterError(f"{name} is never {lit.value!r}; it is one of {', '.join(sorted(allowed))}"
                          + (" or a number" if name in ("op", "cmd", "status") else ""))


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
        check_field(name)
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
        if op in ("==", "!="):
            _check_value(name, lit)
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
            _check_value(name, values[-1])
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


HELP = f"""\
hydra-rpc inspect -Y FILTER shows only the messages FILTER matches (requests and responses).

Examples
  -Y 'op == DECODE and status != OK'              failed DECODEs, request and response
  -Y 'stream == 3 && direction == response'
  -Y 'size > 1MiB or latency >= 250'              big messages, replies slower than 250 ms
  -Y 'op in {{PREFILL DECODE}} and trace contains "bench"'
  -Y 'hydra.meta.error matches "slot .* busy"'     a regular expression (Python syntax)
  -Y 'key == "0" and not hydra.v3.hdr_hash_ok'
  -Y 'proto == ggml and cmd == GRAPH_COMPUTE'

Fields
{chr(10).join(f"  {name:<12} {text}" for name, text in FIELDS.items())}

  Every field -V and --json show can be tested by its dotted name (hydra.kv.n_past,
  hydra.v3.hdr_hash_ok, ggml.tensor.name, …), and a JSON field by a path into it
  (hydra.meta.error). A message that lacks the field does not match, as in Wireshark.

Comparisons
  ==  !=  <  <=  >  >=   (or eq ne lt le gt ge)
  contains               substring of a text, member of a list
  matches  (or ~)        regular expression search
  in {{A B …}}             one of the values
  FIELD alone            present and not empty, false or 0

Combining
  and (&&), or (||), not (!), parentheses; not binds tightest, then and, then or.

Values
  numbers 67, 0x43, 1.5, sizes 64k 4KiB 1MB (k = KiB, kB = 1000); names DECODE, OK, busy
  (any case); "quoted" or 'quoted' strings with \\n \\t escapes; true and false.
  An unknown field, or op/status/cmd/direction/proto compared with a value it never
  has (op == FOO), is an error.
"""
