"""Small helpers shared by the dissectors and renderers."""
from __future__ import annotations

import json
from typing import Any

MAX_LIST = 4096  # longest list (tokens, node ids) put into a field value


class Named(int):
    """An enum-like integer that also knows its name: ``op == DECODE`` and ``op == 0x43``
    both work in filters, and the summary prints the name."""

    name: str

    def __new__(cls, value: int, name: str) -> Named:
        obj = super().__new__(cls, value)
        obj.name = name
        return obj

    def __str__(self) -> str:
        return self.name

    __repr__ = __str__


def human(n: int | None) -> str:
    """``1536`` → ``1.5 KiB``; exact powers print without decimals (``4 GiB``)."""
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        n /= 1024
        if n < 1024 or unit == "EiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
    return f"{n} B"  # pragma: no cover


def text(data: bytes | bytearray | memoryview) -> str:
    """Bytes as text for display: UTF-8 where valid, replacement characters elsewhere."""
    return bytes(data).decode("utf-8", "replace")


def compact(obj: Any, limit: int = 160) -> str:
    try:
        s = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError):
        s = repr(obj)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def jsonable(v: Any) -> Any:
    """Values as the NDJSON writer emits them (Named → name, bytes → hex)."""
    if isinstance(v, Named):
        return v.name
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).hex()
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return str(v)
    return v


def capped(values: Any, limit: int = MAX_LIST) -> tuple[list, bool]:
    """``(first `limit` items as a list, whether the list was cut)``."""
    lst = list(values[:limit]) if hasattr(values, "__getitem__") else list(values)[:limit]
    return lst, len(values) > limit
