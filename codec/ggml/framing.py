"""ggml-RPC framing: headers, HELLO, and what the first bytes of a connection are.

Little-endian, packed, no status and no request id; responses match requests FIFO::

    request   [u8 cmd][u64 size][payload]
    response  [u64 size][payload]        — only for commands that get one at that version

HELLO (command 14, fixed forever) is the first command of every session since 1.0.0: a 24-byte
``conn_caps`` payload since 4.0.0 (all zero = TCP only), empty before; the reply carries the
server's version. docs/ggml.md has the byte-level walk-through.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from construct import Int8ul, Int64ul, Struct

from ..errors import LocalProtocolError, MalformedPayload
from .commands import CONN_CAPS_SIZE, Cmd, Version, normalize_version

Buffer = bytes | bytearray | memoryview

REQUEST_HEADER = Struct("cmd" / Int8ul, "size" / Int64ul)
RESPONSE_HEADER = Struct("size" / Int64ul)
REQUEST_HEADER_STRUCT = struct.Struct("<BQ")  # the hot-path twins
RESPONSE_HEADER_STRUCT = struct.Struct("<Q")


def encode_request_header(cmd: int, size: int) -> bytes:
    """The 9-byte header alone, for a payload that is streamed after it."""
    try:
        return REQUEST_HEADER_STRUCT.pack(cmd, size)
    except struct.error:
        raise LocalProtocolError(f"cmd {cmd} is not a byte or size {size} not a u64", rule="ggml.cmd") from None


def encode_request(cmd: int, payload: Buffer = b"") -> bytes:
    return encode_request_header(cmd, len(payload)) + bytes(payload)


def encode_response(payload: Buffer = b"") -> bytes:
    return RESPONSE_HEADER_STRUCT.pack(len(payload)) + bytes(payload)


@dataclass(frozen=True, slots=True)
class HelloResponse:
    version: Version
    caps: bytes | None  # None for a legacy (1.x–3.x) 3-byte response
    padding: int = 0


def _caps(caps: Buffer | None) -> bytes:
    caps = bytes(CONN_CAPS_SIZE) if caps is None else bytes(caps)
    if len(caps) != CONN_CAPS_SIZE:
        raise LocalProtocolError(f"conn_caps must be {CONN_CAPS_SIZE} bytes", rule="ggml.caps")
    return caps


def encode_hello_request(caps: Buffer | None = None, *, legacy: bool = False) -> bytes:
    """Whole HELLO frame: ``0E 18 00…00`` + caps (4.0+), or ``0E`` + 8 zero bytes (1.x–3.x)."""
    if legacy:
        if caps is not None:
            raise LocalProtocolError("a legacy HELLO carries no caps", rule="ggml.caps")
        return encode_request(Cmd.HELLO)
    return encode_request(Cmd.HELLO, _caps(caps))


def parse_hello_request(payload: Buffer) -> bytes | None:
    """The client's conn_caps (24-byte payload), or None for a legacy empty HELLO."""
    if len(payload) == 0:
        return None
    if len(payload) != CONN_CAPS_SIZE:
        raise MalformedPayload(f"HELLO request of {len(payload)} bytes (0 or 24)", rule="ggml.hello_size")
    return bytes(payload)


def encode_hello_response(version: Iterable[int], caps: Buffer | None = None) -> bytes:
    """Whole HELLO response frame; 28-byte payload for major ≥ 4, else the 3-byte legacy one."""
    v = normalize_version(version)
    assert v is not None
    if v[0] >= 4:
        return encode_response(bytes((*v, 0)) + _caps(caps))
    if caps is not None:
        raise LocalProtocolError("a legacy HELLO response carries no caps", rule="ggml.caps")
    return encode_response(bytes(v))


def parse_hello_response(payload: Buffer) -> HelloResponse:
    if len(payload) == 28:
        return HelloResponse((payload[0], payload[1], payload[2]), bytes(payload[4:]), payload[3])
    if len(payload) == 3:
        return HelloResponse((payload[0], payload[1], payload[2]), None)
    raise MalformedPayload(f"HELLO response of {len(payload)} bytes (3 or 28)", rule="ggml.hello_size")


FirstBytesKind = Literal["hydra", "ggml", "ggml_legacy", "unknown", "incomplete"]


def classify_first_bytes(b: Buffer) -> FirstBytesKind:
    """``59 48`` → hydra; ``0E`` → ggml; any other byte < 0x14 → ggml_legacy (pre-1.0 client);
    anything else → unknown. "incomplete" when too few bytes arrived to decide (``b""`` or a
    lone ``59``): read more, or treat as unknown once the deadline passes.
    """
    if len(b) == 0:
        return "incomplete"
    if b[0] == 0x59:
        if len(b) < 2:
            return "incomplete"
        return "hydra" if b[1] == 0x48 else "unknown"
    if b[0] == Cmd.HELLO:
        return "ggml"
    if b[0] < 0x14:
        return "ggml_legacy"
    return "unknown"


def classify_ggml_hello(first9: Buffer) -> Literal["hello", "hello_legacy", "bad", "incomplete"]:
    """The HELLO header's size: 24 (≥ 4.0), 0 (1.x–3.x), anything else is not a HELLO we know."""
    if len(first9) < 9:
        return "incomplete" if len(first9) == 0 or first9[0] == Cmd.HELLO else "bad"
    if first9[0] != Cmd.HELLO:
        return "bad"
    size = REQUEST_HEADER_STRUCT.unpack_from(first9)[1]
    return "hello" if size == CONN_CAPS_SIZE else "hello_legacy" if size == 0 else "bad"
