"""JSON as both ends of the wire read it: strict like nlohmann (the C++ engine and llama-server),
compact like its ``dump()``. Every JSON payload and meta of the Hydra port goes through here."""
from __future__ import annotations

import json
import re
from typing import Any

from .errors import LocalProtocolError, MalformedPayload

Buffer = bytes | bytearray | memoryview


def _reject_constant(name: str) -> Any:
    # nlohmann (the C++ side) rejects NaN/Infinity literals; Python would accept them.
    raise ValueError(f"{name} is not JSON")


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str, obj: Any) -> str | None:
    """The first lone UTF-16 surrogate in the strings of ``obj`` (parsed from ``text``), or None.

    ``json.loads`` keeps an unpaired ``\\ud800`` escape as a code point no UTF-8 can hold, so the
    string fails wherever it is encoded later (a tokenizer, a log, a reply); nlohmann, and so the
    C++ engine and llama-server, refuse it when parsing. Only text with such an escape is walked.
    """
    if _SURROGATE_ESCAPE.search(text) is None:
        return None
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if (m := _SURROGATE.search(v)) is not None:
                return m.group()
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


def loads_json(data: Buffer | str, rule: str) -> Any:
    """Strict JSON of UTF-8 bytes: any failure → MalformedPayload(rule).

    Stricter than ``json.loads(bytes)``, which would also guess UTF-16/32 and accept NaN. Deep
    nesting (RecursionError), over-long integers (ValueError) and unpaired surrogate escapes
    are parse failures too.
    """
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
        obj = json.loads(text, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MalformedPayload(f"invalid JSON: {str(e)[:200]}", rule=rule) from None
    if (bad := lone_surrogate(text, obj)) is not None:
        raise MalformedPayload(f"invalid JSON: an unpaired UTF-16 surrogate \\u{ord(bad):04x} in a string", rule=rule)
    return obj


# one encoder per flavour for every call: json.dumps with options builds a new JSONEncoder each time
_COMPACT = {nan: json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=nan) for nan in (False, True)}
_ESCAPED = {nan: json.JSONEncoder(separators=(",", ":"), allow_nan=nan) for nan in (False, True)}


def compact_utf8(obj: Any, *, allow_nan: bool = False) -> bytes:
    """Compact UTF-8 JSON. A lone surrogate (a model's JSON text can hold one) has no UTF-8:
    the text is then written with escapes, so it keeps the ``\\udXXX`` the model wrote."""
    try:
        return _COMPACT[allow_nan].encode(obj).encode()
    except UnicodeEncodeError:
        return _ESCAPED[allow_nan].encode(obj).encode()


def dumps_compact(obj: Any, *, rule: str = "json.encode") -> bytes:
    """Compact UTF-8 JSON, like nlohmann ``dump()`` with no indent (no spaces, raw UTF-8)."""
    try:
        return compact_utf8(obj)
    except (TypeError, ValueError, RecursionError) as e:
        raise LocalProtocolError(f"cannot encode JSON: {e}", rule=rule) from None


def parse_json_object(payload: Buffer, rule: str, *, allow_empty: bool = False) -> dict[str, Any]:
    """A payload that must be one JSON object. Empty → ``{}`` only when ``allow_empty``."""
    if len(payload) == 0:
        if allow_empty:
            return {}
        raise MalformedPayload("empty payload", rule=rule)
    obj = loads_json(payload, rule)
    if not isinstance(obj, dict):
        raise MalformedPayload(f"expected a JSON object, got {type(obj).__name__}", rule=rule)
    return obj
