"""Cutting a whole byte string into the Hydra requests it holds.

For tools that have everything that was sent in hand (the fuzzer's oracles and minimizer):
which requests a correct server sees in those bytes, and what follows the last of them. A live
stream goes through :class:`codec.decoder.RequestDecoder` instead, which also enforces the
limits; here nothing is refused for its size, since a fuzzer's lies about lengths are the point,
and no payload is dropped, since the fuzzer judges replies by what each request carried.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import BadMagic
from .framing import REQUEST_HEADER_SIZE, RequestHeader, decode_request_header

Tail = Literal["clean", "partial", "garbage"]


@dataclass(frozen=True, slots=True)
class Frame:
    """One whole request: its parsed header and its bytes as sent (header included)."""

    header: RequestHeader
    raw: bytes

    @property
    def key(self) -> bytes:
        return self.raw[REQUEST_HEADER_SIZE:REQUEST_HEADER_SIZE + self.header.key_len]

    @property
    def trace(self) -> bytes:
        k1 = REQUEST_HEADER_SIZE + self.header.key_len
        return self.raw[k1:k1 + self.header.trace_len]

    @property
    def payload(self) -> bytes:
        return self.raw[REQUEST_HEADER_SIZE + self.header.key_len + self.header.trace_len:]


@dataclass(frozen=True, slots=True)
class Split:
    frames: list[Frame]
    rest: bytes  # the bytes after the last whole request
    # What ``rest`` is: nothing ("clean"); the start of a request that never finished, or too
    # few bytes to tell ("partial"); bytes that are not a request at all, bad magic ("garbage").
    tail: Tail


def split_frames(data: bytes | bytearray | memoryview) -> Split:
    """The whole requests at the start of ``data``, in order, and what follows them.

    Cutting stops at the first header that is incomplete, cut short, or has a bad magic: a
    server cannot find a frame boundary past any of those, so neither can we.
    """
    data = bytes(data)
    frames: list[Frame] = []
    pos = 0
    while pos < len(data):
        if len(data) - pos < REQUEST_HEADER_SIZE:
            return Split(frames, data[pos:], "partial")
        try:
            h = decode_request_header(data[pos:pos + REQUEST_HEADER_SIZE])
        except BadMagic:
            return Split(frames, data[pos:], "garbage")
        end = pos + REQUEST_HEADER_SIZE + h.body_len
        if end > len(data):
            return Split(frames, data[pos:], "partial")
        frames.append(Frame(h, data[pos:end]))
        pos = end
    return Split(frames, b"", "clean")
