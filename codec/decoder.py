"""Incremental (sans-IO) decoders for Hydra request and response streams.

    dec = RequestDecoder(limits)
    dec.feed(data)                  # or, from an asyncio.BufferedProtocol:
                                    #   get_buffer() -> dec.get_buffer(), buffer_updated(n) -> dec.buffer_updated(n)
    for event in dec.events():      # RequestStart, PayloadChunk..., RequestEnd
        ...

A decoder never allocates from a length field: key, trace and meta are buffered only
after their lengths passed the limits, and payloads are handed out as they arrive (whole,
in one chunk, when they are no larger than ``buffer_threshold``). A consumer that wants a
large payload in its own buffer calls :meth:`receive_into`: the bytes already buffered are
copied there, and :meth:`get_buffer` then offers the rest of that buffer to the transport,
so the payload is received straight into its destination and never past its end.

A refused frame (key, trace or payload over its limit) raises ``FrameTooLarge`` once; the
decoder then *skips* the rest of that frame and reports ``RequestEnd(skipped=True)``, so the
stream stays in sync — the caller decides whether to keep reading (a server answers and
drains, an observer notes it and moves on). Skipping is bounded by ``limits.max_drain``: a
frame with more left than that is final (``recoverable`` False), like ``BadMagic``, whose
stream cannot be re-synchronised: every later call raises the same error again.

Requests of an op in ``limits.ignore_payload_ops`` (STATE_GET, STATE_META, INFO) start with
``payload_len`` 0 in their ``RequestStart``: whatever payload was sent is skipped, never
handed out — a server serves the request as if none came.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Union

from .decoder_state import TRANSITIONS, Phase, advance
from .enums import op_name
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

RECV_BUFFER = 64 * 1024  # the receive buffer's size (allocated on first use; shrunk back to it when empty)
MIN_RECV = 4 * 1024  # get_buffer offers at least this much room


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()


@dataclass(frozen=True, slots=True)
class RequestStart:
    header: RequestHeader
    key: bytes
    trace: bytes
    payload_len: int  # payload bytes that follow as PayloadChunks (0 when the op ignores its payload)


@dataclass(frozen=True, slots=True)
class ResponseStart:
    header: ResponseHeader
    meta: bytes


@dataclass(frozen=True, slots=True)
class PayloadChunk:
    data: bytes


@dataclass(frozen=True, slots=True)
class RequestEnd:
    skipped: bool = False


@dataclass(frozen=True, slots=True)
class ResponseEnd:
    skipped: bool = False


RequestEvent = Union[RequestStart, PayloadChunk, RequestEnd]
ResponseEvent = Union[ResponseStart, PayloadChunk, ResponseEnd]

# The phases as module globals: on Python 3.11 an Enum member lookup (``Phase.HEAD``) costs
# several times a global's, and the decoder looks at its phase several times per frame.
_HEAD, _PREAMBLE, _PAYLOAD, _SKIP, _BROKEN = Phase.HEAD, Phase.PREAMBLE, Phase.PAYLOAD, Phase.SKIP, Phase.BROKEN


class _Decoder:
    """Receive buffer and state machine (its phases and legal moves: ``codec.decoder_state``);
    subclasses know their header and preamble."""

    _header_size: int

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()
        self._buf = bytearray()
        self._view = memoryview(self._buf)
        self._start = 0  # first unconsumed byte in _buf
        self._end = 0  # end of the received bytes in _buf
        self._state = _HEAD
        self._header = None
        self._remaining = 0  # payload bytes (or skipped bytes) still to come
        self._error: Exception | None = None
        self._sink: memoryview | None = None  # receive_into destination
        self._sink_pos = 0
        self.offset = 0  # stream offset of the first unconsumed byte (for observers)

    # -- input ---------------------------------------------------------------
    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Room for the next received bytes: the rest of a ``receive_into`` destination, or the
        receive buffer (compacted or grown only here — never while the transport may still hold
        the previous view)."""
        if self._sink is not None:
            return self._sink[self._sink_pos:]
        start, end = self._start, self._end
        if start == end:
            self._start = self._end = start = end = 0
            if len(self._buf) > RECV_BUFFER:
                self._replace(bytearray(RECV_BUFFER))
        want = MIN_RECV  # not the transport's hint: a partial frame must not double the buffer each time
        if len(self._buf) - end < want:
            if start:
                self._buf[: end - start] = self._view[start:end]
                self._start, self._end = 0, end - start
                end -= start
            if len(self._buf) - end < want:
                grown = bytearray(max(2 * len(self._buf), end + want, RECV_BUFFER))
                grown[:end] = self._view[:end]
                self._replace(grown)
        return self._view[end:]

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were written into the view the last ``get_buffer`` returned."""
        if self._sink is None:
            self._end += nbytes
            return
        self._sink_pos += nbytes
        self._remaining -= nbytes
        self.offset += nbytes
        if self._sink_pos == len(self._sink):
            self._sink = None

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        data = memoryview(data).cast("B")
        while data:
            room = self.get_buffer()
            n = min(len(room), len(data))
            room[:n] = data[:n]
            self.buffer_updated(n)
            data = data[n:]

    def _replace(self, buf: bytearray) -> None:
        self._buf, self._view = buf, memoryview(buf)

    @property
    def header(self):
        """The current frame's header once it is parsed (between frames: the last one's)."""
        return self._header

    @property
    def buffered(self) -> int:
        return self._end - self._start

    @property
    def at_boundary(self) -> bool:
        """True between frames: nothing of a frame has been consumed yet."""
        return self._state is _HEAD

    @property
    def wanted(self) -> int:
        """Bytes still to receive before the next event can be produced (the rest of the header,
        of the key and trace or meta, of the payload). A reader that asks for no more than this
        never reads past the part it is waiting for — a caller may read a payload itself after
        the start event."""
        buffered = self.buffered
        if self._state is _HEAD:
            return max(0, self._header_size - buffered)
        if self._state is _PREAMBLE:
            return max(0, self._preamble_len() - buffered)
        if self._state in (_PAYLOAD, _SKIP):
            return max(0, self._remaining - buffered - self.receiving)
        return 0

    @property
    def receiving(self) -> int:
        """Bytes still expected into the ``receive_into`` destination."""
        return 0 if self._sink is None else len(self._sink) - self._sink_pos

    @property
    def payload_remaining(self) -> int:
        """Payload bytes of the current request not handed out yet (0 outside a payload)."""
        return self._remaining if self._state is _PAYLOAD else 0

    def receive_into(self, dest: memoryview) -> int:
        """Let the next ``len(dest)`` payload bytes land in ``dest``. Returns how many were
        already buffered (and are copied now); ``receiving`` counts the rest, which
        ``get_buffer`` offers to the transport."""
        if self._state is not _PAYLOAD or len(dest) > self._remaining or self._sink is not None:
            raise ValueError("receive_into needs a payload with that many bytes left")
        n = min(self.buffered, len(dest))
        dest[:n] = self._view[self._start:self._start + n]
        self._start += n
        self._remaining -= n
        self.offset += n
        if n < len(dest):
            self._sink, self._sink_pos = dest, n
        return n

    # -- events --------------------------------------------------------------
    def events(self) -> Iterator:
        while True:
            ev = self.next_event()
            if ev is NEED_DATA:
                return
            yield ev

    def _take(self, n: int) -> bytes:
        out = self._view[self._start:self._start + n].tobytes()
        self._start += n
        self.offset += n
        return out

    def _discard(self, n: int) -> None:
        self._start += n
        self.offset += n

    def _goto(self, phase: Phase) -> None:
        if phase not in TRANSITIONS[self._state]:  # checked here, not in a call: this runs per frame
            advance(self._state, phase, type(self).__name__)  # raises IllegalTransition
        self._state = phase

    def _fail(self, err: FrameTooLarge, skip: int) -> FrameTooLarge:
        """Refuse the current frame: skip ``skip`` more bytes, or break when that is over the
        drain bound."""
        err.header = self._header  # type: ignore[attr-defined]
        if skip > self.limits.max_drain:
            err.recoverable = False
            self._break(err)
            self._start = self._end = 0  # a frame this big is never read: drop what was buffered of it
        else:
            self._goto(_SKIP)
            self._remaining = skip
        return err

    def _break(self, err: Exception) -> None:
        self._goto(_BROKEN)
        self._error = err

    def next_event(self):
        if self._state is _BROKEN:
            raise self._error  # type: ignore[misc]
        if self._state is _HEAD and not self._read_header():
            return NEED_DATA
        if self._state is _PREAMBLE:
            return self._preamble_event()
        if self._state is _PAYLOAD:
            return self._payload_event()
        return self._skip_event()  # SKIP, the only phase left

    def _read_header(self) -> bool:
        """Parse the header once it is all in (False: not yet)."""
        if self._end - self._start < self._header_size:
            return False
        try:
            self._header = self._parse_header(self._view[self._start:self._start + self._header_size])
        except BadMagic as e:
            self._break(e)
            raise
        self._discard(self._header_size)
        self._goto(_PREAMBLE)
        self._check_limits()
        return True

    def _preamble_event(self):
        n = self._preamble_len()
        if self._end - self._start < n:
            return NEED_DATA
        start = self._make_start(self._take(n))
        self._remaining = self._header.payload_len
        # A payload the start event does not announce (an op that takes none) is skipped.
        self._goto(_PAYLOAD if self._remaining == self._payload_len(start) else _SKIP)
        return start

    def _skip_event(self):
        n = min(self._remaining, self._end - self._start)
        self._discard(n)
        self._remaining -= n
        if self._remaining:
            return NEED_DATA
        self._goto(_HEAD)
        return self._end_event(True)

    def _payload_event(self):
        if self._remaining == 0:
            self._goto(_HEAD)
            return self._end_event(False)
        buffered = self._end - self._start
        total = self._header.payload_len
        if total <= self.limits.buffer_threshold and self._remaining == total:
            # Small payload: hand it out whole.
            if buffered < total:
                return NEED_DATA
            self._remaining = 0
            return PayloadChunk(self._take(total))
        if not buffered or self._sink is not None:
            return NEED_DATA
        n = min(self._remaining, buffered)
        self._remaining -= n
        return PayloadChunk(self._take(n))

    def skip_payload(self) -> None:
        """Discard the rest of the current frame's payload (e.g. after an error reply).

        Raises ``FrameTooLarge`` (not recoverable) when more than ``limits.max_drain`` is left.
        """
        if self._state is _PAYLOAD:
            if self._remaining > self.limits.max_drain:
                raise self._fail(FrameTooLarge(f"{self._remaining} unread payload bytes are more than the "
                                               f"{self.limits.max_drain} a connection drains", rule="req.drain"),
                                 self._remaining)
            self._goto(_SKIP)


class RequestDecoder(_Decoder):
    _header_size = REQUEST_HEADER_SIZE

    def _parse_header(self, raw) -> RequestHeader:
        return decode_request_header(raw)

    def _check_limits(self) -> None:
        h: RequestHeader = self._header
        lim = self.limits
        if h.key_len > lim.max_key_len or h.trace_len > lim.max_trace_len:
            rule = "req.key_len" if h.key_len > lim.max_key_len else "req.trace_len"
            raise self._fail(FrameTooLarge(f"key_len {h.key_len}/trace_len {h.trace_len} over the limit "
                                           f"{lim.max_key_len}/{lim.max_trace_len}", rule=rule), h.body_len)
        if h.op in lim.ignore_payload_ops:
            if h.payload_len > lim.max_drain:
                raise self._fail(FrameTooLarge(f"payload of {h.payload_len} bytes on {op_name(h.op)}, which "
                                               f"takes none", rule="req.ignored_payload"), h.body_len)
        elif h.payload_len > lim.payload_cap(h.op):
            raise self._fail(FrameTooLarge(f"payload_len {h.payload_len} exceeds the {op_name(h.op)} limit of "
                                           f"{lim.payload_cap(h.op)} bytes", rule="req.payload_len"), h.body_len)

    def _preamble_len(self) -> int:
        return self._header.key_len + self._header.trace_len

    def _make_start(self, raw: bytes) -> RequestStart:
        h = self._header
        payload_len = 0 if h.op in self.limits.ignore_payload_ops else h.payload_len
        return RequestStart(h, raw[:h.key_len], raw[h.key_len:], payload_len)

    @staticmethod
    def _payload_len(start: RequestStart) -> int:
        return start.payload_len

    def _end_event(self, skipped: bool) -> RequestEnd:
        return RequestEnd(skipped)


class ResponseDecoder(_Decoder):
    _header_size = RESPONSE_HEADER_SIZE

    def _parse_header(self, raw) -> ResponseHeader:
        return decode_response_header(raw)

    def _check_limits(self) -> None:
        h: ResponseHeader = self._header
        if h.meta_len > self.limits.max_meta_len:
            raise self._fail(FrameTooLarge(f"meta_len {h.meta_len} exceeds {self.limits.max_meta_len}",
                                           rule="resp.meta_len"), h.meta_len + h.payload_len)

    def _preamble_len(self) -> int:
        return self._header.meta_len

    def _make_start(self, raw: bytes) -> ResponseStart:
        return ResponseStart(self._header, raw)

    @staticmethod
    def _payload_len(start: ResponseStart) -> int:
        return start.header.payload_len

    def _end_event(self, skipped: bool) -> ResponseEnd:
        return ResponseEnd(skipped)
