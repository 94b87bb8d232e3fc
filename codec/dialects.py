"""Which dialect a PREFILL or DECODE speaks, decided from the bytes — one function per decision.

The server's handlers, the fuzzer and the inspector all call these, so they can never disagree:

* :func:`prefill_dialect` — PREFILL: a JSON chat body, or E1 raw i32 tokens;
* :func:`looks_like_decode_v3_prefix` — DECODE, from its first 16 bytes only (what a server that
  streams the payload decides on): a merged v3 frame or not;
* :func:`decode_dialect` — DECODE, from the whole payload (or a captured prefix): v3, E1/A5 raw
  tokens, PIN JSON, or the spec's JSON (``"stream": false``);
* :func:`pin_stream_follows` — after a response header: whether PIN's ``[u32 len][piece]``
  stream follows it, up to the close (parsed by :class:`codec.payloads.PieceStreamDecoder`).

Two facts make the dialects separable from the bytes alone:

* JSON text never contains a NUL byte;
* every real token id is < 2**24 (vocabularies are < 16.7 M), so the high byte of each
  little-endian i32 token is 0x00.
"""
from __future__ import annotations

import enum
import struct
from typing import Any, Mapping

from .enums import Status
from .errors import MalformedPayload
from .framing import ResponseHeader
from .json_text import parse_json_object
from .payloads import HYDRA_MAX_JSON_HEADER, Buffer, _first_non_ws


class Dialect(enum.Enum):
    """``value`` is (opcode, the short label tools show, e.g. the inspector's ``dialect``)."""

    PREFILL_JSON = ("PREFILL", "json")
    PREFILL_E1 = ("PREFILL", "e1")
    DECODE_V3 = ("DECODE", "v3")
    DECODE_PIN = ("DECODE", "pin")  # JSON body: OK, meta_len 0, payload_len 0, then pieces until the close
    DECODE_SPEC = ("DECODE", "json-frames")  # JSON body with "stream": false: meta + 9-byte token frames
    DECODE_E1 = ("DECODE", "e1")  # [i32 n_predict][i32 tokens...] (E1 and A5): meta + text

    @property
    def label(self) -> str:
        return self.value[1]


V3_PREFIX_PROBE = 16  # bytes that decide whether a DECODE payload is a v3 frame
_U32 = struct.Struct("<I")


def _looks_like_json_object(payload: Buffer) -> bool:
    return _first_non_ws(payload) == ord("{") and 0 not in bytes(payload[:4])


def _all_tokens_small(payload: Buffer, first: int) -> bool:
    """Every i32 from index ``first`` has a zero high byte (len % 4 == 0 assumed)."""
    high = bytes(memoryview(payload)[first * 4 + 3 :: 4])
    return high.count(0) == len(high)


def _looks_like_tokens(payload: Buffer, first: int) -> bool:
    return len(payload) >= 4 and len(payload) % 4 == 0 and _all_tokens_small(payload, first)


def prefill_dialect(payload: Buffer) -> Dialect:
    """PREFILL dialect. Precedence:

    1. JSON — first non-whitespace byte is ``{`` and no NUL in the first 4 bytes;
    2. E1 — ``len % 4 == 0``, ``len ≥ 4`` and every i32 has a zero high byte;
    3. JSON otherwise (NEW's dialect: the JSON parser reports the error; this is also the
       answer for an empty payload, which NEW rejects).

    Token 123 (``7B 00 00 00``) starts with ``{`` but has NULs, so it is E1.
    """
    if not _looks_like_json_object(payload) and _looks_like_tokens(payload, 0):
        return Dialect.PREFILL_E1
    return Dialect.PREFILL_JSON


def looks_like_decode_v3_prefix(first: Buffer) -> bool:
    """The first 16 bytes look like ``[u32 hdr_len ≤ 32768][u64 hash]{JSON…``.

    The JSON starts with ``{`` and its first 4 bytes have no NUL (hdr_len ≥ 4); an E1 DECODE
    payload has a token's zero high byte at offset 15, so it can never pass. A JSON body's first
    4 bytes read as a u32 are ≥ 0x0909097B, far above 32768, so JSON never passes either.
    """
    if len(first) < V3_PREFIX_PROBE:
        return False
    hdr_len = _U32.unpack_from(first, 0)[0]
    return 4 <= hdr_len <= HYDRA_MAX_JSON_HEADER and first[12] == ord("{") and 0 not in bytes(first[12:16])


def decode_json_dialect(body: Mapping[str, Any]) -> Dialect:
    """A JSON DECODE body: the spec's token frames when it says ``"stream": false``, else PIN."""
    return Dialect.DECODE_SPEC if body.get("stream") is False else Dialect.DECODE_PIN


def decode_dialect(payload: Buffer) -> Dialect:
    """DECODE dialect. Precedence:

    1. v3 — :func:`looks_like_decode_v3_prefix` and the whole control header present;
    2. JSON — first non-whitespace byte ``{``, no NUL in the first 4 bytes; then
       :func:`decode_json_dialect` of the body (PIN when it does not parse: the JSON parser
       reports the error);
    3. E1 — ``len % 4 == 0``, ``len ≥ 4``, every token after n_predict has a zero high byte
       (n_predict itself may be anything);
    4. v3 otherwise: NEW's dialect, whose validator names the broken rule.
    """
    if looks_like_decode_v3_prefix(payload) and len(payload) >= 12 + _U32.unpack_from(payload, 0)[0]:
        return Dialect.DECODE_V3
    if _looks_like_json_object(payload):
        try:
            return decode_json_dialect(parse_json_object(payload, "decode.json"))
        except MalformedPayload:
            return Dialect.DECODE_PIN
    if _looks_like_tokens(payload, 1):
        return Dialect.DECODE_E1
    return Dialect.DECODE_V3


def pin_stream_follows(dialect: Dialect | None, header: ResponseHeader) -> bool:
    """Whether PIN's ``[u32 len][piece]`` frames follow this response header, until the close.

    Only an answer to a PIN DECODE that is exactly ``OK, meta_len 0, payload_len 0`` starts a
    stream: that is what the PIN engine and this server send before the first piece. Any other
    head (an error, a meta, a payload) is an ordinary response — the spec dialect's OK with a
    meta and no tokens (payload_len 0) is complete as it is.
    """
    return (dialect is Dialect.DECODE_PIN and header.status == Status.OK and header.meta_len == 0
            and header.payload_len == 0)
