"""XXH3-64 helpers and the ``"xxh3:%016x"`` hash strings of the wire (docs/protocol.md §11).

The engine puts ``kv_hash_str`` (XXH3-64 of the whole PREFILL payload) in the PREFILL meta,
and the DECODE v3 frame carries the same string form for its segments plus a raw u64 XXH3-64
of the control header. Everything here is seedless XXH3-64, as in the C++ and C# code.
"""
from __future__ import annotations

import re

import xxhash

from .errors import LocalProtocolError, MalformedPayload

HASH_PREFIX = "xxh3:"
_U64_MAX = (1 << 64) - 1
# The C++ checks "xxh3:" then hex digits. 1..16 digits fit a u64; we refuse anything
# int(x, 16) would also swallow ("0x", "_", spaces, signs) so a string parses one way only.
_HEX_RE = re.compile(r"[0-9a-fA-F]{1,16}")

Buffer = bytes | bytearray | memoryview


def xxh3_64(data: Buffer) -> int:
    """Seedless XXH3-64 of ``data`` as an unsigned int."""
    return xxhash.xxh3_64_intdigest(data)


def kv_hash_str(value: Buffer | int) -> str:
    """``"xxh3:%016x"`` (lowercase, zero-padded) of a digest, or of the bytes given."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value <= _U64_MAX:
            raise LocalProtocolError(f"hash {value} does not fit in a u64", rule="hash.range")
        digest = value
    elif isinstance(value, (bytes, bytearray, memoryview)):
        digest = xxh3_64(value)
    else:
        raise LocalProtocolError(f"cannot hash {type(value).__name__}", rule="hash.type")
    return f"{HASH_PREFIX}{digest:016x}"


def parse_hash_str(s: object, *, rule: str = "hash.format") -> int:
    """The u64 in an ``"xxh3:<hex>"`` string. Anything else → MalformedPayload(rule).

    Accepts any input type (it usually comes straight out of peer JSON), upper- or
    lowercase hex, 1–16 digits.
    """
    if isinstance(s, (bytes, bytearray, memoryview)):
        try:
            s = bytes(s).decode("ascii")
        except UnicodeDecodeError:
            raise MalformedPayload("hash string is not ASCII", rule=rule) from None
    if not isinstance(s, str):
        raise MalformedPayload(f"hash must be a string, got {type(s).__name__}", rule=rule)
    if not s.startswith(HASH_PREFIX):
        raise MalformedPayload(f"hash {s[:40]!r} lacks the {HASH_PREFIX!r} prefix", rule=rule)
    digits = s[len(HASH_PREFIX):]
    if not _HEX_RE.fullmatch(digits):
        raise MalformedPayload(f"hash {s[:40]!r} is not 1-16 hex digits", rule=rule)
    return int(digits, 16)


class Xxh3Stream:
    """Incremental XXH3-64 for payloads that are streamed, never held whole.

    >>> h = Xxh3Stream(); h.update(b"ab"); h.update(b"c"); h.kv_hash_str() == kv_hash_str(b"abc")
    True
    """

    __slots__ = ("_h", "length")

    def __init__(self, data: Buffer = b"") -> None:
        self._h = xxhash.xxh3_64()
        self.length = 0  # bytes hashed so far, handy to check a declared segment length
        if data:
            self.update(data)

    def update(self, data: Buffer) -> None:
        self._h.update(data)
        self.length += len(data) if not isinstance(data, memoryview) else data.nbytes

    def intdigest(self) -> int:
        return self._h.intdigest()

    def hexdigest(self) -> str:
        """16 lowercase hex digits (no prefix)."""
        return f"{self._h.intdigest():016x}"

    def kv_hash_str(self) -> str:
        return kv_hash_str(self._h.intdigest())

    def copy(self) -> Xxh3Stream:
        other = Xxh3Stream.__new__(Xxh3Stream)
        other._h = self._h.copy()
        other.length = self.length
        return other
