"""Scanning JSON that a model is still writing.

``json.loads`` answers only for complete text. Streaming needs more: where a value starts and
ends in the text, the keys of an object seen so far, and whether a prefix can still become
valid. The scanners here find value boundaries (matching brackets, skipping strings) and
leave full validation to ``json.loads`` once a value is complete. Every Python-level step
consumes a whole string or run of plain characters, so long values cost few steps.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass


class JsonError(ValueError):
    """The text can never become valid JSON, whatever is appended."""


class Incomplete(Exception):
    """The text ends before the value does."""


_WS = re.compile(r"[ \t\n\r]*")
# A string body: greedy and without a required end, so a string still open costs one pass
# instead of a failed match that backtracks.
_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_OPEN = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?\Z")
_PLAIN = re.compile(r'[^"{}\[\]]*')
_LITERALS = ("true", "false", "null")
_CLOSER = {"{": "}", "[": "]"}


class Memo:
    """Work done on a text that only ever grows, kept for the next, longer version of it:
    a stream re-parses its answer per token, and without this would rescan it all each time.
    A fresh Memo for each unrelated text."""

    def __init__(self) -> None:
        self._found: dict[tuple[str, int], tuple[int, int]] = {}
        self._loaded: dict[tuple[int, int], object] = {}
        self.values: dict[int, tuple[list[str], int, bool] | None] = {}  # value_end's resume states
        self.strings: dict[int, tuple[int, str]] = {}  # decode_string_prefix's progress
        self.results: dict[tuple, object] = {}  # callers' own settled results, by their own keys

    def find(self, text: str, sub: str, start: int) -> int:
        """``text.find(sub, start)``; a search that found nothing resumes where it stopped."""
        hit = self._found.get((sub, start))
        frm = start
        if hit is not None:
            pos, upto = hit
            if pos >= 0:
                return pos
            frm = max(start, upto - len(sub) + 1)
        pos = text.find(sub, frm)
        self._found[(sub, start)] = (pos, len(text))
        return pos

    def loads(self, text: str, a: int, b: int) -> object:
        """``json.loads(text[a:b])`` of a complete span (None when invalid), computed once."""
        key = (a, b)
        if key not in self._loaded:
            self._loaded[key] = loads_or_none(text[a:b])
        return self._loaded[key]


def skip_ws(text: str, i: int) -> int:
    """The index of the first non-whitespace character at or after ``i``."""
    return _WS.match(text, i).end()


def _string_close(text: str, j: int) -> int:
    """Index of the quote closing the string whose body starts at ``j``. Incomplete carries
    the position to resume from (never inside an escape sequence)."""
    k = _BODY.match(text, j).end()
    if k < len(text) and text[k] == '"':
        return k
    raise Incomplete(k)


def string_end(text: str, i: int) -> int:
    """End of the JSON string starting at ``text[i] == '"'``."""
    return _string_close(text, i + 1) + 1


def _scalar_end(text: str, i: int) -> int:
    c = text[i]
    if c == '"':
        return string_end(text, i)
    for lit in _LITERALS:
        if text.startswith(lit, i):
            return i + len(lit)
        if lit.startswith(text[i:i + len(lit)]) and len(text) - i < len(lit):
            raise Incomplete
    if _NUMBER_OPEN.match(text, i):  # a number reaching the end of the text may still grow
        raise Incomplete
    m = _NUMBER.match(text, i)
    if m and m.end() > i:
        return m.end()
    raise JsonError(f"unexpected {c!r}")


def value_end(text: str, i: int, memo: Memo | None = None) -> int:
    """End of the JSON value starting at ``text[i]`` (not whitespace). Containers are matched
    bracket for bracket, their inner grammar left to ``json.loads``. With a memo, scanning an
    unfinished container resumes where the previous call stopped."""
    if i >= len(text):
        raise Incomplete
    if text[i] == '"' and memo is not None:  # long string answers are scanned once, too
        return _resumed_string_end(text, i, memo)
    if text[i] not in _CLOSER:
        return _scalar_end(text, i)
    state = memo.values.get(i, False) if memo is not None else False
    if state is None:
        raise JsonError("mismatched bracket")
    stack, j, in_string = (list(state[0]), state[1], state[2]) if state else ([_CLOSER[text[i]]], i + 1, False)
    try:
        while stack:
            if in_string:
                j = _string_close(text, j) + 1
                in_string = False
                continue
            j = _PLAIN.match(text, j).end()
            if j >= len(text):
                raise Incomplete(j)
            c = text[j]
            j += 1
            if c == '"':
                in_string = True
            elif c in _CLOSER:
                stack.append(_CLOSER[c])
            elif c != stack.pop():
                raise JsonError("mismatched bracket")
    except Incomplete as e:
        if memo is not None:
            memo.values[i] = (stack, e.args[0], in_string)
        raise
    except JsonError:
        if memo is not None:
            memo.values[i] = None  # a wrong bracket stays wrong
        raise
    return j


def _resumed_string_end(text: str, i: int, memo: Memo) -> int:
    state = memo.values.get(i)
    try:
        return _string_close(text, state[1] if state else i + 1) + 1
    except Incomplete as e:
        memo.values[i] = ([], e.args[0], True)
        raise


@dataclass
class Member:
    """One ``key: value`` of an object; ``end`` is None while the value is still open."""

    key: str
    start: int
    end: int | None


@dataclass
class ObjectScan:
    """The members of an object seen so far; ``end`` is None while the object is open."""

    members: list[Member]
    end: int | None

    def get(self, key: str) -> Member | None:
        for m in self.members:
            if m.key == key:
                return m
        return None


def scan_object(text: str, i: int, memo: Memo | None = None) -> ObjectScan:
    """The members of the object starting at ``text[i] == '{'``, as far as the text goes.
    Raises JsonError when the structure can never become a valid object."""
    members: list[Member] = []
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        return ObjectScan(members, j + 1)
    try:
        while True:
            if j >= len(text):
                raise Incomplete
            if text[j] != '"':
                raise JsonError("expected a key")
            k = string_end(text, j)
            key = json.loads(text[j:k])
            j = skip_ws(text, k)
            if j >= len(text):
                raise Incomplete
            if text[j] != ":":
                raise JsonError("expected ':'")
            j = skip_ws(text, j + 1)
            if j >= len(text):
                raise Incomplete
            member = Member(key, j, None)
            members.append(member)
            member.end = value_end(text, j, memo)
            j = skip_ws(text, member.end)
            if j >= len(text):
                raise Incomplete
            if text[j] == "}":
                return ObjectScan(members, j + 1)
            if text[j] != ",":
                raise JsonError("expected ',' or '}'")
            j = skip_ws(text, j + 1)
    except Incomplete:
        return ObjectScan(members, None)


def loads_or_none(raw: str) -> object:
    """``json.loads(raw)``, or None when it fails (callers check the type they need)."""
    try:
        return json.loads(raw)
    except ValueError:
        return None


_COMPLETE_CHARS = re.compile(r'(?:[^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*', re.S)
_HIGH_SURROGATE_TAIL = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}\Z")


def decode_string_prefix(text: str, i: int, memo: Memo | None = None) -> str:
    """The characters of the (maybe unterminated) JSON string at ``text[i] == '"'`` that can no
    longer change: an escape sequence is decoded only once complete, and a high surrogate only
    with its partner. With a memo, only the text added since the last call is decoded."""
    done, decoded = memo.strings.get(i, (i + 1, "")) if memo is not None else (i + 1, "")
    raw = _COMPLETE_CHARS.match(text, done).group()
    if _HIGH_SURROGATE_TAIL.search(raw):
        raw = raw[:-6]
    try:
        decoded += json.loads('"' + raw + '"')
    except ValueError:  # a raw control character: nothing more is sure to show
        return decoded
    if memo is not None:
        memo.strings[i] = (done + len(raw), decoded)
    return decoded
