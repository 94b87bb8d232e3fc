"""Hydra frame headers: the 16-byte request header and the 12-byte response header.

Wire layout (docs/protocol.md §2): every integer little-endian, no padding.

    request   magic u16 (0x4859 → bytes 59 48) | op u8 | flags u8 | key_len u16 |
              payload_len u64 | trace_len u16      then key, trace, payload
    response  status u8 | meta_len u24 | payload_len u64   then meta (JSON), payload

``REQUEST_HEADER`` / ``RESPONSE_HEADER`` (construct) are the declarative source of
truth: the inspector and fuzzer use them to name fields and byte offsets. The
per-request hot path uses the precompiled ``struct`` twins below; a hypothesis test
(tests/test_codec_framing.py) proves both agree on every 16/12-byte input.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

from construct import Int8ul, Int16ul, Int24ul, Int64ul, Struct

from .enums import Status
from .errors import BadMagic, LocalProtocolError, Truncated

MAGIC = 0x4859
MAGIC_BYTES = b"\x59\x48"  # what 0x4859 looks like on the wire ("YH")
REQUEST_HEADER_SIZE = 16
RESPONSE_HEADER_SIZE = 12
MAX_META_LEN = 0xFFFFFF  # u24
MAX_KEY_LEN = 0xFFFF  # u16
MAX_U64 = 0xFFFF_FFFF_FFFF_FFFF

REQUEST_HEADER = Struct(
    "magic" / Int16ul,
    "op" / Int8ul,
    "flags" / Int8ul,
    "key_len" / Int16ul,
    "payload_len" / Int64ul,
    "trace_len" / Int16ul,
)
RESPONSE_HEADER = Struct(
    "status" / Int8ul,
    "meta_len" / Int24ul,
    "payload_len" / Int64ul,
)

_REQ = struct.Struct("<HBBHQH")
# status and the u24 meta_len share one little-endian u32: status is its low byte.
_RESP = struct.Struct("<IQ")


class RequestHeader(NamedTuple):
    op: int
    flags: int
    key_len: int
    payload_len: int
    trace_len: int
    magic: int = MAGIC

    @property
    def body_len(self) -> int:
        """Bytes that follow the header: key + trace + payload."""
        return self.key_len + self.trace_len + self.payload_len


class ResponseHeader(NamedTuple):
    status: int
    meta_len: int
    payload_len: int


def decode_request_header(data: bytes | bytearray | memoryview) -> RequestHeader:
    """Parse 16 header bytes. Bad magic raises ``BadMagic`` (close without reply)."""
    if len(data) < REQUEST_HEADER_SIZE:
        raise Truncated(f"request header needs 16 bytes, got {len(data)}", rule="hdr.short")
    magic, op, flags, key_len, payload_len, trace_len = _REQ.unpack_from(data)
    if magic != MAGIC:
        raise BadMagic(f"bad magic {bytes(data[:2]).hex(' ')} (want 59 48)", rule="hdr.magic")
    return RequestHeader(op, flags, key_len, payload_len, trace_len, magic)


def encode_request_header(op: int, key_len: int, payload_len: int, trace_len: int, flags: int = 0,
                          magic: int = MAGIC) -> bytes:
    if not (0 <= key_len <= MAX_KEY_LEN and 0 <= trace_len <= MAX_KEY_LEN):
        # The C# client silently truncates here and desyncs; we refuse.
        raise LocalProtocolError(f"key_len/trace_len must fit u16 (got {key_len}, {trace_len})")
    if not 0 <= payload_len <= MAX_U64:
        raise LocalProtocolError(f"payload_len must fit u64 (got {payload_len})")
    return pack_request_header_unchecked(op, key_len, payload_len, trace_len, flags, magic)


def pack_request_header_unchecked(op: int, key_len: int, payload_len: int, trace_len: int, flags: int = 0,
                                  magic: int = MAGIC) -> bytes:
    """A request header that says whatever it is told, each field cut to its width: for fuzzers
    and tests whose headers lie about what follows. Everything else uses
    :func:`encode_request_header`, which refuses what the fields cannot carry."""
    return _REQ.pack(magic & 0xFFFF, op & 0xFF, flags & 0xFF, key_len & 0xFFFF, payload_len & MAX_U64,
                     trace_len & 0xFFFF)


def encode_request(op: int, key: str | bytes = b"", payload: bytes = b"", trace: str | bytes = b"",
                   flags: int = 0) -> bytes:
    """A whole request as bytes (header + key + trace + payload)."""
    k = key.encode() if isinstance(key, str) else bytes(key)
    t = trace.encode() if isinstance(trace, str) else bytes(trace)
    return b"".join((encode_request_header(op, len(k), len(payload), len(t), flags), k, t, payload))


def decode_response_header(data: bytes | bytearray | memoryview) -> ResponseHeader:
    if len(data) < RESPONSE_HEADER_SIZE:
        raise Truncated(f"response header needs 12 bytes, got {len(data)}", rule="resp.short")
    word, payload_len = _RESP.unpack_from(data)
    return ResponseHeader(word & 0xFF, word >> 8, payload_len)


def encode_response_header(status: int, meta_len: int, payload_len: int) -> bytes:
    if not 0 <= meta_len <= MAX_META_LEN:
        # The C++ writes the low 24 bits and corrupts the stream; we refuse.
        raise LocalProtocolError(f"meta is {meta_len} bytes, more than the u24 field holds")
    if not 0 <= status <= 0xFF or not 0 <= payload_len <= MAX_U64:
        raise LocalProtocolError(f"bad status {status} or payload_len {payload_len}")
    return _RESP.pack(status | (meta_len << 8), payload_len)


def encode_response(status: int | Status, meta: bytes = b"", payload: bytes = b"") -> bytes:
    return encode_response_header(int(status), len(meta), len(payload)) + meta + payload
