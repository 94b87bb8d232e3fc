"""Grammar-constrained sampling that never lets llama.cpp abort the process.

llama.cpp's grammar sampler throws a C++ exception ("Unexpected empty grammar stack") or
aborts (an end-of-generation token while the grammar is incomplete) when it *accepts* a token
the grammar does not allow; across ctypes either kills the server. So the grammar never goes
into the sampler chain: ``engine.llama_backend.sampler.sample_row`` does what llama-server's
``common_sampler_sample`` does (sample, check the one token, resample under the grammar when it
is refused), and a token is accepted only after the grammar's own ``apply`` allowed it. When no
token is allowed it raises :class:`GrammarExhausted` and accepts nothing.

Lazy grammars are handled here too, not by llama.cpp: its trigger regexes run in ``std::regex``
(which throws on a bad pattern and recurses per character of the searched text), and its
replay of the triggering text throws when that text breaks the grammar. Here the triggers are
Python regexes and the replay is checked on a clone before the real grammar sees it.
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

import llama_cpp.llama_cpp as L

from ..sampling import GrammarExhausted, GrammarSpec, grammar_nesting
from . import vocab as vocab_mod
from .runtime import LlamaBackendError, last_llama_errors
from ..utf8 import owed_after, unfinished, valid_prefix

MAX_GRAMMAR_BYTES = 256 * 1024
MAX_GRAMMAR_NESTING = 64  # llama.cpp's parser recurses once per parenthesis level
MAX_TRIGGER_PATTERNS = 16
TRIGGER_WINDOW = 4096  # unanchored triggers are searched in the last this-many bytes (+ the new piece)

# numpy twin of llama_token_data: the chain reads and writes it in place
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert TOKEN_DATA.itemsize == ctypes.sizeof(L.llama_token_data)


# ---- checks that run before any C call ------------------------------------------------
def _bound(text: str, root: str) -> bytes:
    if not isinstance(text, str) or not text.strip():
        raise ValueError("grammar is empty")
    if not isinstance(root, str) or not re.fullmatch(r"[A-Za-z0-9-]+", root):
        raise ValueError(f"grammar root {root!r} is not a rule name")
    raw = text.encode("utf-8")
    if len(raw) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"grammar is {len(raw)} bytes, more than {MAX_GRAMMAR_BYTES}")
    if "\0" in text:
        raise ValueError("grammar contains a NUL character")
    if grammar_nesting(text) > MAX_GRAMMAR_NESTING:
        raise ValueError(f"grammar nests parentheses deeper than {MAX_GRAMMAR_NESTING}")
    return raw


_stderr_lock = threading.Lock()


def _parse_quietly(raw: bytes, root: bytes) -> tuple[bool, str]:
    """``llama_sampler_init_grammar(NULL, …)``: parse only (a NULL vocabulary parses everything
    but ``<[token]>`` references). The parser prints its reason with ``fprintf(stderr)``, not
    through the log callback, so fd 2 is borrowed for the call; whatever else was written
    meanwhile is put back."""
    with _stderr_lock, tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            try:
                smpl = L.llama_sampler_init_grammar(None, raw, root)
            finally:
                os.dup2(saved, 2)
        finally:
            os.close(saved)
        if smpl:
            L.llama_sampler_free(smpl)
        tmp.seek(0)
        captured = tmp.read().decode("utf-8", "replace")
    reason = ""
    other = []
    for line in captured.splitlines():
        if "error parsing grammar" in line and not reason:
            reason = line.split("error parsing grammar:", 1)[-1].strip()
        elif line.strip() and not reason:
            other.append(line)
    if other:  # not ours: somebody else's output written during the call
        os.write(2, ("\n".join(other) + "\n").encode())
    return bool(smpl), reason


def check_grammar(text: str, root: str = "root") -> None:
    """Raise ``ValueError`` (with llama.cpp's reason where it gives one) unless ``text`` is a
    GBNF grammar llama.cpp parses with rule ``root``. Cheap (parses only, no vocabulary), safe
    on the event loop, and bounded before the C parser runs: at most 256 KiB, parentheses at
    most 64 deep."""
    raw = _bound(text, root)
    ok, reason = _parse_quietly(raw, root.encode())
    if ok:
        return
    if not reason:
        logged = [ln for ln in last_llama_errors(4) if "grammar" in ln or "recursion" in ln]
        reason = logged[-1].strip() if logged else "failed to parse grammar"
    raise ValueError(f"invalid grammar: {reason}")


# what a trigger pattern may start with to match "anywhere after here": llama.cpp's chat
# formats write their triggers so (``[\s\S]*?(<tool_call>)[\s\S]*``)
_ANY_LAZY = (r"[\s\S]*?", r"[\S\s]*?")


@dataclass(frozen=True)
class Trigger:
    """A compiled trigger regex (bytes, like llama.cpp's). ``anchored``: it must match the whole
    text. ``unprefixed``: a leading lazy any-text run was taken off: searched as it was, such a
    pattern matches at the search's first position whenever it matches at all, and finding that
    tries the rest of it at every later position for each one — quadratic in the text, 100 ms a
    token on 4 KB of text. Searched without it, the match (and every group) is the same, found
    by one scan; only where the pattern's match would start differs (:func:`trigger_start`)."""

    pattern: re.Pattern[bytes]
    anchored: bool
    unprefixed: bool = False


def _top_level_alternation(body: str) -> bool:
    """Does ``body`` have a ``|`` outside every group and character class? Then a leading lazy
    run belongs to its first alternative only, and cannot be taken off the whole."""
    depth, in_class, i = 0, False, 0
    while i < len(body):
        c = body[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class, i = True, i + (2 if body[i + 1:i + 2] == "]" else 1)  # "[]...]": a literal ] first
            continue
        elif c in "()":
            depth += 1 if c == "(" else -1
        elif c == "|" and depth == 0:
            return True
        i += 1
    return False


# a request's triggers are compiled where its chat is planned (check_grammar_spec) and again
# for its sampler, and the formats' few patterns recur in every request with tools
@functools.lru_cache(maxsize=64)
def _compile_trigger(p: str) -> Trigger:
    anchored = p.startswith("^") and p.endswith("$")
    body, unprefixed = p, False
    if not anchored and not _top_level_alternation(p):
        while body.startswith(_ANY_LAZY):
            body, unprefixed = body[len(_ANY_LAZY[0]):], True  # the two spellings are as long
    try:
        return Trigger(re.compile((body or p).encode("utf-8")), anchored, unprefixed and bool(body))
    except re.error as e:
        raise ValueError(f"grammar trigger pattern {p!r}: {e}") from None


def compile_triggers(spec: GrammarSpec) -> list[Trigger]:
    """The spec's trigger regexes, compiled."""
    if len(spec.trigger_patterns) > MAX_TRIGGER_PATTERNS:
        raise ValueError(f"more than {MAX_TRIGGER_PATTERNS} grammar trigger patterns")
    out = []
    for p in spec.trigger_patterns:
        if not isinstance(p, str) or not p or len(p) > 4096:
            raise ValueError(f"grammar trigger pattern {p!r} is empty, not a string or too long")
        out.append(_compile_trigger(p))
    if spec.lazy and not out and not spec.trigger_tokens:
        raise ValueError("a lazy grammar needs a trigger pattern or token")
    return out


def trigger_start(trigger: Trigger, buf: bytes) -> int | None:
    """Where the grammar's text starts if ``trigger`` fires on ``buf`` (None: it does not): the
    first non-empty group of the match, else the match's start, as llama.cpp's lazy grammar.
    An unanchored pattern is searched in the last TRIGGER_WINDOW bytes."""
    if trigger.anchored:
        m, off = trigger.pattern.fullmatch(buf), 0
    else:
        off = max(0, len(buf) - TRIGGER_WINDOW)
        m = trigger.pattern.search(buf, off)
    if m is None:
        return None
    for g in range(1, (m.re.groups or 0) + 1):
        if m.start(g) >= 0 and m.end(g) > m.start(g):
            return m.start(g)
    return off if trigger.unprefixed else m.start(0)  # a lazy any-text run matches from the first position


def check_grammar_spec(spec: GrammarSpec) -> None:
    """:func:`check_grammar` plus the trigger patterns of a lazy grammar."""
    compile_triggers(spec)
    check_grammar(spec.text, spec.root)


# ---- the grammar, with laziness -----------------------------------------------------------
def token_array(cur: np.ndarray, size: int | None = None) -> Any:
    """A ``llama_token_data_array`` over ``cur`` (``TOKEN_DATA``) in place: the chain writes into it."""
    return L.llama_token_data_array(
        cur.ctypes.data_as(L.llama_token_data_p), len(cur) if size is None else size, -1, False)


class _Probe:
    """A one-token candidate array, built once: the probe runs for nearly every token."""

    def __init__(self) -> None:
        self.one = np.zeros(1, dtype=TOKEN_DATA)
        self.ref = ctypes.byref(token_array(self.one))

    def allowed(self, grammar: Any, tok: int) -> bool:
        one = self.one[0]
        one["id"], one["logit"] = tok, 1.0
        L.llama_sampler_apply(grammar, self.ref)
        return bool(np.isfinite(one["logit"]))


def _allowed_alone(grammar: Any, tok: int, probe: _Probe | None = None) -> bool:
    """The rejection-sampling probe: apply the grammar to a one-token array."""
    return (probe or _Probe()).allowed(grammar, tok)


@dataclass
class _Pending:
    tok: int
    grammar: Any  # the clone that already replayed the triggering text
    tail: bytes  # the replayed text's last bytes (what they owe in UTF-8)


class GrammarConstraint:
    """One generation's grammar. :meth:`allows` and :meth:`apply` never change state;
    :meth:`accept` must only be given a token :meth:`allows` approved."""

    def __init__(self, voc: Any, spec: GrammarSpec, utf8: np.ndarray | None = None,
                 pieces: list[bytes] | None = None) -> None:
        self._triggers = compile_triggers(spec)
        # tokens llama.cpp's grammar would take although they make the text invalid UTF-8
        # (engine/utf8.py): row k applies while k continuation bytes are owed
        self._utf8 = utf8
        self._tail = b""  # the last bytes accepted while active, for what they still owe
        self._probe = _Probe()
        self._pieces = pieces  # every token's bytes (LoadedModel.token_pieces), else asked one by one
        self._mid_char: dict[bytes, np.ndarray] = {}  # an unfinished character → tokens that continue it
        raw = _bound(spec.text, spec.root)
        g = L.llama_sampler_init_grammar(voc, raw, spec.root.encode())
        if not g:
            raise ValueError(f"invalid grammar: {'; '.join(last_llama_errors(2)) or 'failed to parse grammar'}")
        self._g: Any = g
        self._voc = voc
        self.active = not spec.lazy
        self._trigger_tokens = frozenset(int(t) for t in spec.trigger_tokens)
        self._buf = bytearray()  # text generated while awaiting the trigger
        self._spans: list[tuple[int, int, int]] = []  # (token, start, end) in _buf
        self._pending: _Pending | None = None

    def free(self) -> None:
        self._drop_pending()
        if self._g is not None:
            L.llama_sampler_free(self._g)
            self._g = None

    def _drop_pending(self) -> None:
        if self._pending is not None:
            L.llama_sampler_free(self._pending.grammar)
            self._pending = None

    def _piece(self, tok: int) -> bytes:
        if self._pieces is not None:
            return self._pieces[tok]
        return vocab_mod.token_to_piece(self._voc, tok, True)

    def apply(self, cur: np.ndarray) -> None:
        """Set the logit of every candidate the grammar refuses to -inf (no-op before a trigger)."""
        if self.active:
            L.llama_sampler_apply(self._g, ctypes.byref(token_array(cur)))
            if self._utf8 is not None:
                cur["logit"][~self._utf8_allowed()[cur["id"]]] = -np.inf

    def _utf8_allowed(self) -> np.ndarray:
        assert self._utf8 is not None
        owed = owed_after(self._tail)
        row = self._utf8[owed]
        if owed == 0:
            return row  # exact from a character boundary
        head = unfinished(self._tail)
        exact = self._mid_char.get(head)
        if exact is None:  # mid-character: the few tokens that continue one, checked exactly
            exact = row.copy()
            for t in np.flatnonzero(row):
                exact[t] = valid_prefix(head + self._piece(int(t)))
            self._mid_char[head] = exact
        return exact

    def _utf8_ok(self, tok: int, tail: bytes | None = None) -> bool:
        if self._utf8 is None:
            return True
        tail = self._tail if tail is None else tail
        owed = owed_after(tail)
        return bool(self._utf8[owed, tok]) and (owed == 0 or valid_prefix(unfinished(tail) + self._piece(tok)))

    def allows(self, tok: int) -> bool:
        if self.active:
            return self._utf8_ok(tok) and self._probe.allowed(self._g, tok)
        replay = self._replay_for(tok)
        if replay is None:
            return True  # no trigger yet: unconstrained
        if self._pending is not None and self._pending.tok == tok:
            return True
        self._drop_pending()
        if -1 in replay:
            return False
        clone = L.llama_sampler_clone(self._g)
        if not clone:
            raise LlamaBackendError("llama_sampler_clone failed")
        tail = b""
        for t in replay:
            if not self._utf8_ok(t, tail) or not _allowed_alone(clone, t):
                L.llama_sampler_free(clone)
                return False  # the triggering text breaks the grammar: refuse this token
            L.llama_sampler_accept(clone, t)
            tail = (tail + self._piece(t))[-4:]
        self._pending = _Pending(tok, clone, tail)
        return True

    def accept(self, tok: int) -> None:
        if self.active:
            L.llama_sampler_accept(self._g, tok)
            self._tail = (self._tail + self._piece(tok))[-4:]
            return
        if self._pending is None or self._pending.tok != tok:
            if not self.allows(tok):
                raise GrammarExhausted("token refused by the grammar trigger")
        if self._pending is not None and self._pending.tok == tok:
            L.llama_sampler_free(self._g)
            self._g, self._tail = self._pending.grammar, self._pending.tail
            self._pending = None
            self.active = True
            self._buf.clear()
            self._spans.clear()
            return
        piece = self._piece(tok)
        self._spans.append((tok, len(self._buf), len(self._buf) + len(piece)))
        self._buf += piece

    def _replay_for(self, tok: int) -> list[int] | None:
        """The tokens the grammar must accept if ``tok`` fires a trigger (None: it does not).
        Like llama.cpp, the grammar gets the text from the first non-empty group on; a token cut
        by that start is re-tokenized, and refused when that does not spell the same bytes."""
        if tok in self._trigger_tokens:
            return [tok]
        if not self._triggers:
            return None
        piece = self._piece(tok)
        buf = bytes(self._buf) + piece
        start = self._find(buf)
        if start is None:
            return None
        spans = self._spans + [(tok, len(self._buf), len(buf))]
        out: list[int] = []
        for t, s, e in spans:
            if e <= start:
                continue
            if s >= start:
                out.append(t)
                continue
            part = buf[start:e]
            toks = vocab_mod.tokenize(self._voc, part, False, False)
            if b"".join(self._piece(x) for x in toks) != part:
                return [-1]  # cannot be replayed faithfully: refuse the token
            out.extend(toks)
        return out

    def _find(self, buf: bytes) -> int | None:
        for trigger in self._triggers:
            start = trigger_start(trigger, buf)
            if start is not None:
                return start
        return None
