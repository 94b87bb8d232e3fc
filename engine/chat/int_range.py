"""Integer bounds as GBNF: llama.cpp's ``build_min_max_int``, on digit strings.

llama-cpp-python's Python port of the schema converter ignores ``minimum``/``maximum`` for
integers; llama.cpp's C++ converter enforces them. This is that, rewritten on digit strings
(see ``int_range_rule``), without three of its slips: a minimum-only bound that drops leading
zeros (``minimum: 105`` let 100 and 15 through), a negative maximum that allows ``-01``, and a
16-digit minimum that wrote an invalid ``{16,15}``.
"""
from __future__ import annotations

import math

INT_DIGITS = 16
INT_LIMIT = 10 ** INT_DIGITS - 1
INT_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def int_bounds(schema: dict) -> tuple[int, int]:
    """The inclusive range an integer schema allows, clipped to 16-digit integers. Numeric
    bounds are rounded inwards like llama.cpp (``minimum`` up, ``exclusiveMinimum`` x → floor(x)
    + 1, …). Where llama.cpp refuses a boolean ``exclusiveMinimum``/``exclusiveMaximum``, here it
    has its draft-4 meaning (``true`` makes ``minimum``/``maximum`` exclusive); where a schema
    has both a numeric ``minimum`` and ``exclusiveMinimum``, the tighter one holds (llama.cpp
    keeps ``minimum`` only)."""
    def num(key: str) -> float | int | None:
        v = schema.get(key)
        if key not in schema or (isinstance(v, bool) and key.startswith("exclusive")):
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"schema {key} must be a number" + (" or a boolean" if key.startswith("e") else ""))
        return v

    lo, hi = -INT_LIMIT, INT_LIMIT
    mn, mx, xmn, xmx = (num(k) for k in INT_BOUNDS)
    if mn is not None:
        lo = max(lo, math.floor(mn) + 1 if schema.get("exclusiveMinimum") is True else math.ceil(mn))
    if xmn is not None:
        lo = max(lo, math.floor(xmn) + 1)
    if mx is not None:
        hi = min(hi, math.ceil(mx) - 1 if schema.get("exclusiveMaximum") is True else math.floor(mx))
    if xmx is not None:
        hi = min(hi, math.ceil(xmx) - 1)
    if lo > hi:
        raise ValueError(f"schema integer bounds allow no integer of at most {INT_DIGITS} digits")
    return lo, hi


def _digit_class(lo: str, hi: str) -> str:
    return f"[{lo}]" if lo == hi else f"[{lo}-{hi}]"


def _any_digits(n: int, m: int | None = None) -> str:
    m = n if m is None else m
    return "[0-9]" if n == m == 1 else f"[0-9]{{{n}}}" if n == m else f"[0-9]{{{n},{m}}}"


def _uniform_range(lo: str, hi: str) -> str:
    """Strings of ``len(lo) == len(hi)`` digits from ``lo`` to ``hi`` (llama.cpp's
    ``uniform_range``): a sequence, its alternatives in parentheses, one level per digit."""
    i = 0
    while i < len(lo) and lo[i] == hi[i]:
        i += 1
    head = f'"{lo[:i]}"' if i else ""
    if i == len(lo):
        return head
    f, t, n = lo[i], hi[i], len(lo) - i - 1
    if n == 0:
        tail = _digit_class(f, t)
    else:
        zeros, nines = "0" * n, "9" * n
        lo_rest, hi_rest = lo[i + 1:], hi[i + 1:]
        alts, first, last = [], f, t
        if lo_rest != zeros:  # the first digit with a partial rest
            alts.append(f"[{f}] {_uniform_range(lo_rest, nines)}")
            first = chr(ord(f) + 1)
        if hi_rest != nines:
            last = chr(ord(t) - 1)
        if first <= last:  # first digits followed by anything
            alts.append(f"{_digit_class(first, last)} {_any_digits(n)}")
        if hi_rest != nines:  # the last digit with a partial rest
            alts.append(f"[{t}] {_uniform_range(zeros, hi_rest)}")
        tail = alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"
    return f"{head} {tail}" if head else tail


def _nonneg_range(lo: int, hi: int) -> str:
    """Non-negative integers ``lo..hi`` without leading zeros: per number of digits, the whole
    lengths merged into one ``[1-9] [0-9]{m,n}``."""
    alts: list[str] = []
    full: list[int] = []  # consecutive lengths with every number in range

    def flush() -> None:
        if full:
            more = "" if full[-1] == 1 else " " + _any_digits(full[0] - 1, full[-1] - 1)
            alts.append("[1-9]" + more)
            full.clear()

    for d in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (d - 1) if d > 1 else 0), min(hi, 10 ** d - 1)
        if a == 10 ** (d - 1) and b == 10 ** d - 1:
            full.append(d)
        else:
            flush()
            alts.append(_uniform_range(str(a), str(b)))
    flush()
    return " | ".join(alts)


def int_range_rule(lo: int, hi: int) -> str:
    """GBNF for the JSON integers ``lo..hi`` (``-0`` not included)."""
    if hi < 0:
        return f'"-" ({_nonneg_range(-hi, -lo)})'
    if lo >= 0:
        return _nonneg_range(lo, hi)
    return f'"-" ({_nonneg_range(1, -lo)}) | {_nonneg_range(0, hi)}'
