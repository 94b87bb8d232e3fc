"""Streaming sans-IO decoders for both directions of a ggml-RPC connection.

``feed(bytes) -> [events]``; a payload up to ``max_buffered`` arrives whole in the Complete
event, a larger one as PayloadChunks, so a huge claimed size is never held in memory.
"""
from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import FrameTooLarge, MalformedPayload, RemoteProtocolError, Truncated
from .commands import Cmd, command_table, normalize_version
from .framing import REQUEST_HEADER_STRUCT, RESPONSE_HEADER_STRUCT, Buffer, parse_hello_response


@dataclass(frozen=True, slots=True)
class RequestHeader:
    cmd: int
    size: int


@dataclass(frozen=True, slots=True)
class ResponseHeader:
    cmd: int  # the request it answers (FIFO)
    size: int
    expected_size: int | None  # from the command table; a mismatch makes the real client abort


@dataclass(frozen=True, slots=True)
class PayloadChunk:
    data: bytes  # only for payloads larger than the decoder's max_buffered


@dataclass(frozen=True, slots=True)
class RequestComplete:
    cmd: int
    size: int
    payload: bytes | None  # None when it was emitted as PayloadChunks


@dataclass(frozen=True, slots=True)
class ResponseComplete:
    cmd: int
    size: int
    payload: bytes | None


DEFAULT_MAX_BUFFERED = 1 << 20


class _FrameDecoder:
    """Header, then payload bytes passed through without ever holding a big payload whole."""

    _HEADER: struct.Struct

    def __init__(self, max_buffered: int, max_size: int | None) -> None:
        self.max_buffered = max_buffered
        self.max_size = max_size
        self._hdr = bytearray()
        self._remaining: int | None = None  # None = reading a header
        self._collect: bytearray | None = None

    @property
    def in_frame(self) -> bool:
        return bool(self._hdr) or self._remaining is not None

    def eof(self) -> None:
        """Call at end of stream: stopping inside a frame is Truncated."""
        pending = getattr(self, "_pending_error", None)
        if pending is not None:
            raise pending
        if self.in_frame:
            raise Truncated("stream ended inside a ggml-rpc frame", rule="ggml.eof")

    def _feed(self, data: Buffer) -> list[Any]:
        # A refused frame found after complete ones in the same feed() is raised on the
        # next call, so the frames before it are never lost.
        pending = getattr(self, "_pending_error", None)
        if pending is not None:
            raise pending
        events: list[Any] = []
        mv = memoryview(data).cast("B")
        pos, n, hsize = 0, len(mv), self._HEADER.size
        while True:
            if self._remaining is None:
                if pos >= n:
                    break
                take = min(hsize - len(self._hdr), n - pos)
                self._hdr += mv[pos : pos + take]
                pos += take
                if len(self._hdr) < hsize:
                    break
                fields = self._HEADER.unpack(self._hdr)
                self._hdr.clear()
                size = fields[-1]
                if self.max_size is not None and size > self.max_size:
                    err = FrameTooLarge(f"ggml-rpc frame of {size} bytes > {self.max_size}", rule="ggml.size")
                    err.recoverable = False
                    if events:
                        self._pending_error = err
                        return events
                    raise err
                events.append(self._on_header(fields))
                self._remaining = size
                self._collect = bytearray() if size <= self.max_buffered else None
            if self._remaining:
                take = min(self._remaining, n - pos)
                if take == 0:
                    break
                if self._collect is not None:
                    self._collect += mv[pos : pos + take]
                else:
                    events.append(PayloadChunk(bytes(mv[pos : pos + take])))
                pos += take
                self._remaining -= take
            if self._remaining == 0:
                payload = bytes(self._collect) if self._collect is not None else None
                self._remaining, self._collect = None, None
                events.append(self._on_end(payload))
        return events

    def _on_header(self, fields: tuple[int, ...]) -> Any:
        raise NotImplementedError

    def _on_end(self, payload: bytes | None) -> Any:
        raise NotImplementedError


class GgmlRequestDecoder(_FrameDecoder):
    """Client → server: ``feed(bytes) -> [RequestHeader, PayloadChunk…, RequestComplete, …]``.

    Payloads up to ``max_buffered`` arrive whole in RequestComplete; larger ones as chunks.
    ``max_size`` (optional) refuses a frame before any of it is read (FrameTooLarge).
    """

    _HEADER = REQUEST_HEADER_STRUCT

    def __init__(self, *, max_buffered: int = DEFAULT_MAX_BUFFERED, max_size: int | None = None) -> None:
        super().__init__(max_buffered, max_size)
        self._cmd = 0
        self._size = 0

    def feed(self, data: Buffer) -> list[Any]:
        return self._feed(data)

    def _on_header(self, fields: tuple[int, ...]) -> RequestHeader:
        self._cmd, self._size = fields
        return RequestHeader(self._cmd, self._size)

    def _on_end(self, payload: bytes | None) -> RequestComplete:
        return RequestComplete(self._cmd, self._size, payload)


class GgmlResponseDecoder(_FrameDecoder):
    """Server → client. Responses carry no command, so the decoder keeps the FIFO of requests
    sent (``feed(data, expected_cmds)`` or :meth:`expect`) and, when a response arrives, skips
    the ones that get no reply under the current table — evaluated at that moment, so requests
    queued before the HELLO response are judged by the negotiated version. A command the table
    does not know is assumed answered (forks add commands). After a HELLO response the table
    switches to the reported version (``auto_version``).
    """

    _HEADER = RESPONSE_HEADER_STRUCT

    def __init__(
        self,
        version: Iterable[int] | None = None,
        fork: str | None = None,
        *,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
        max_size: int | None = None,
        auto_version: bool = True,
    ) -> None:
        super().__init__(max_buffered, max_size)
        self.fork = fork
        self.version = normalize_version(version)
        self.table = command_table(self.version, fork)
        self.auto_version = auto_version
        self.pending: deque[int] = deque()
        self._cmd = 0
        self._size = 0

    def expect(self, cmd: int) -> None:
        self.pending.append(cmd)

    def set_version(self, version: Iterable[int] | None) -> None:
        self.version = normalize_version(version)
        self.table = command_table(self.version, self.fork)

    def feed(self, data: Buffer, expected_cmds: Iterable[int] = ()) -> list[Any]:
        self.pending.extend(expected_cmds)
        return self._feed(data)

    def _on_header(self, fields: tuple[int, ...]) -> ResponseHeader:
        while self.pending:
            cmd = self.pending.popleft()
            info = self.table.get(cmd)
            if info is None or info.has_response:
                self._cmd, self._size = cmd, fields[0]
                return ResponseHeader(cmd, fields[0], info.response_size if info else None)
        err = RemoteProtocolError("response with no request awaiting one", rule="ggml.unsolicited")
        err.recoverable = False
        raise err

    def _on_end(self, payload: bytes | None) -> ResponseComplete:
        if self.auto_version and self._cmd == Cmd.HELLO and payload is not None:
            try:
                self.set_version(parse_hello_response(payload).version)
            except MalformedPayload:
                pass  # the header event already showed the size mismatch
        return ResponseComplete(self._cmd, self._size, payload)
