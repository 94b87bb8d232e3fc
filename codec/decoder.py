"""Incremental (sans-IO) decoders for Hydra request and response streams.

    dec = RequestDecoder(limits)
    dec.feed(data)
    for event in dec.events():   # RequestStart, PayloadChunk..., RequestEnd
        ...

A decoder never allocates from a length field: key, trace and meta are buffered
only after their lengths passed the limits, and payloads are handed out as they
arrive (whole, in one chunk, when they are no larger than ``buffer_threshold``).

A refused frame (key or payload over its limit) raises ``FrameTooLarge`` once; the
decoder then *skips* the rest of that frame and reports ``RequestEnd(skipped=True)``,
so the stream stays in sync — the caller decides whether to keep reading (a server
drains and answers, an inspector notes it and moves on). ``BadMagic`` is final:
the stream cannot be re-synchronised and every later call raises it again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Union

from .errors import BadMagic, FrameTooLarge
from .framing import (
    REQUEST_HEADER_SIZE,
    RESPONSE_HEADER_SIZE,
    RequestHeader,
    ResponseHeader,
    decode_request_header,
    decode_response_header,
)
from .limits import Limits


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()


@dataclass(frozen=True)
class RequestStart:
    header: RequestHeader
    key: bytes
    trace: bytes


@dataclass(frozen=True)
class ResponseStart:
    header: ResponseHeader
    meta: bytes


@dataclass(frozen=True)
class PayloadChunk:
    data: bytes


@dataclass(frozen=True)
class RequestEnd:
    skipped: bool = False


@dataclass(frozen=True)
class ResponseEnd:
    skipped: bool = False


RequestEvent = Union[RequestStart, PayloadChunk, RequestEnd]
ResponseEvent = Union[ResponseStart, PayloadChunk, ResponseEnd]

_HEAD, _PREAMBLE, _PAYLOAD, _SKIP, _BROKEN = range(5)


class _Decoder:
    """Shared buffer/state machine; subclasses know their header and preamble."""

    _header_size: int

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()
        self._buf = bytearray()
        self._state = _HEAD
        self._header = None
        self._remaining = 0  # payload bytes (or skipped bytes) still to come
        self._error: Exception | None = None
        self.offset = 0  # stream offset of the first byte in _buf (for inspectors)

    # -- input ---------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        if data:
            self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def at_boundary(self) -> bool:
        """True between frames: nothing of a frame has been consumed yet."""
        return self._state == _HEAD

    def events(self) -> Iterator:
        while True:
            ev = self.next_event()
            if ev is NEED_DATA:
                return
            yield ev

    def _take(self, n: int) -> bytes:
        out = bytes(self._buf[:n])
        # Deleting from the front of a bytearray is amortised O(1) in CPython.
        del self._buf[:n]
        self.offset += n
        return out

    def _start_skip(self, n: int) -> None:
        self._state = _SKIP
        self._remaining = n

    def next_event(self):
        if self._state == _BROKEN:
            raise self._error  # type: ignore[misc]
        if self._state == _HEAD:
            if len(self._buf) < self._header_size:
                return NEED_DATA
            try:
                self._header = self._parse_header(bytes(self._buf[: self._header_size]))
            except BadMagic as e:
                self._state, self._error = _BROKEN, e
                raise
            self._take(self._header_size)
            self._state = _PREAMBLE
            self._check_limits()  # may raise FrameTooLarge after switching to _SKIP
        if self._state == _PREAMBLE:
            n = self._preamble_len()
            if len(self._buf) < n:
                return NEED_DATA
            start = self._make_start(self._take(n))
            self._remaining = self._header.payload_len
            self._state = _PAYLOAD
            return start
        if self._state == _PAYLOAD:
            return self._payload_event()
        if self._state == _SKIP:
            n = min(self._remaining, len(self._buf))
            self._take(n)
            self._remaining -= n
            if self._remaining:
                return NEED_DATA
            self._state = _HEAD
            return self._end(skipped=True)
        raise AssertionError(self._state)

    def _payload_event(self):
        if self._remaining == 0:
            self._state = _HEAD
            return self._end(skipped=False)
        total = self._header.payload_len
        if total <= self.limits.buffer_threshold and self._remaining == total:
            # Small payload: hand it out whole.
            if len(self._buf) < total:
                return NEED_DATA
            self._remaining = 0
            return PayloadChunk(self._take(total))
        if not self._buf:
            return NEED_DATA
        n = min(self._remaining, len(self._buf))
        self._remaining -= n
        return PayloadChunk(self._take(n))

    def skip_payload(self) -> None:
        """Discard the rest of the current frame's payload (e.g. after an error reply)."""
        if self._state == _PAYLOAD:
            self._start_skip(self._remaining)


class RequestDecoder(_Decoder):
    _header_size = REQUEST_HEADER_SIZE

    def _parse_header(self, raw: bytes) -> RequestHeader:
        return decode_request_header(raw)

    def _check_limits(self) -> None:
        h: RequestHeader = self._header
        lim = self.limits
        problem = None
        if h.key_len > lim.max_key_len:
            problem = ("req.key_len", f"key_len {h.key_len} exceeds {lim.max_key_len}")
        elif h.trace_len > lim.max_trace_len:
            problem = ("req.trace_len", f"trace_len {h.trace_len} exceeds {lim.max_trace_len}")
        elif h.payload_len > lim.payload_cap(h.op):
            problem = ("req.payload_len",
                       f"payload_len {h.payload_len} exceeds {lim.payload_cap(h.op)} for op 0x{h.op:02X}")
        if problem:
            self._start_skip(h.body_len)
            err = FrameTooLarge(problem[1], rule=problem[0])
            err.header = h  # type: ignore[attr-defined]
            raise err

    def _preamble_len(self) -> int:
        return self._header.key_len + self._header.trace_len

    def _make_start(self, raw: bytes) -> RequestStart:
        k = self._header.key_len
        return RequestStart(self._header, raw[:k], raw[k:])

    def _end(self, skipped: bool) -> RequestEnd:
        return RequestEnd(skipped)


class ResponseDecoder(_Decoder):
    _header_size = RESPONSE_HEADER_SIZE

    def _parse_header(self, raw: bytes) -> ResponseHeader:
        return decode_response_header(raw)

    def _check_limits(self) -> None:
        h: ResponseHeader = self._header
        if h.meta_len > self.limits.max_meta_len:
            self._start_skip(h.meta_len + h.payload_len)
            err = FrameTooLarge(f"meta_len {h.meta_len} exceeds {self.limits.max_meta_len}",
                                rule="resp.meta_len")
            err.header = h  # type: ignore[attr-defined]
            raise err

    def _preamble_len(self) -> int:
        return self._header.meta_len

    def _make_start(self, raw: bytes) -> ResponseStart:
        return ResponseStart(self._header, raw)

    def _end(self, skipped: bool) -> ResponseEnd:
        return ResponseEnd(skipped)
