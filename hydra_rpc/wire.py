"""What a handler sees of one request: the parsed head, a bounded body reader and
a response writer that guarantees exactly one well-formed response.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from codec.enums import Status
from codec.framing import RequestHeader, encode_response_header
from codec.payloads import encode_meta

CHUNK = 256 * 1024


class PeerGone(ConnectionError):
    """The client closed or reset the connection while its request was running."""


DIRECT_MIN = 4 << 20  # below this the stream reader's copies do not matter


class _DirectReceive(asyncio.BufferedProtocol):
    """Temporarily stands in for the connection's stream protocol and lets the transport
    write received bytes directly into the destination buffer; never asks for more than
    the payload, so the next request's bytes stay with the stream reader."""

    def __init__(self, transport: asyncio.Transport, mv: memoryview, pos: int):
        self.transport = transport
        self.previous = transport.get_protocol()
        self.mv = mv
        self.pos = pos
        self.done = asyncio.get_running_loop().create_future()
        self._restored = False

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.mv[self.pos:]

    def buffer_updated(self, nbytes: int) -> None:
        self.pos += nbytes
        if self.pos >= len(self.mv):
            self.restore()
            if not self.done.done():
                self.done.set_result(None)

    def eof_received(self) -> bool:
        self.restore()
        if not self.done.done():
            self.done.set_exception(PeerGone("client closed the connection mid-payload"))
        return bool(self.previous.eof_received())

    def connection_lost(self, exc) -> None:
        self.restore()
        if not self.done.done():
            self.done.set_exception(PeerGone("client closed the connection mid-payload"))
        self.previous.connection_lost(exc)

    def restore(self) -> None:
        if not self._restored:
            self._restored = True
            if not self.transport.is_closing():
                self.transport.set_protocol(self.previous)


class Body:
    """The request payload, read on demand and never beyond ``payload_len``."""

    def __init__(self, reader: asyncio.StreamReader, length: int, stall_timeout: float):
        self._reader = reader
        self.length = length
        self.remaining = length
        self._stall = stall_timeout

    async def _read_some(self, n: int) -> bytes:
        async with asyncio.timeout(self._stall):
            data = await self._reader.read(min(n, self.remaining))
        if not data:
            raise PeerGone("client closed the connection mid-payload")
        self.remaining -= len(data)
        return data

    async def read_all(self) -> bytes:
        """The whole payload (the caller has checked the size against its limit)."""
        if self.remaining == 0:
            return b""
        async with asyncio.timeout(self._stall + self.remaining / (1 << 20)):
            try:
                data = await self._reader.readexactly(self.remaining)
            except asyncio.IncompleteReadError as e:
                raise PeerGone("client closed the connection mid-payload") from e
        self.remaining = 0
        return data

    async def read_exactly(self, n: int) -> bytes:
        if n > self.remaining:
            raise ValueError("read past the end of the payload")
        async with asyncio.timeout(self._stall + n / (1 << 20)):
            try:
                data = await self._reader.readexactly(n)
            except asyncio.IncompleteReadError as e:
                raise PeerGone("client closed the connection mid-payload") from e
        self.remaining -= n
        return data

    async def read_into(self, buf: bytearray | memoryview) -> None:
        """Fill ``buf`` (len ≤ remaining) with the next payload bytes.

        Large payloads are received straight into ``buf`` (see ``_DirectReceive``): the
        stream reader would copy every byte twice (socket → its buffer → a bytes object →
        ``buf``), which caps a 256 MiB STATE_PUT far below loopback speed.
        """
        mv = memoryview(buf).cast("B")
        if len(mv) >= DIRECT_MIN and self._reader._transport is not None:  # noqa: SLF001
            await self._read_direct(mv)
            return
        pos = 0
        while pos < len(mv):
            chunk = await self._read_some(min(CHUNK * 4, len(mv) - pos))
            mv[pos:pos + len(chunk)] = chunk
            pos += len(chunk)

    async def _read_direct(self, mv: memoryview) -> None:
        reader = self._reader
        pending = reader._buffer  # noqa: SLF001 - bytes the stream layer already holds
        pos = min(len(pending), len(mv))
        mv[:pos] = pending[:pos]
        del pending[:pos]
        self.remaining -= pos
        if pos == len(mv):
            return
        transport = reader._transport  # noqa: SLF001
        receiver = _DirectReceive(transport, mv, pos)
        transport.set_protocol(receiver)
        transport.resume_reading()  # the stream layer may have paused it (buffer full)
        try:
            async with asyncio.timeout(self._stall + len(mv) / (64 << 20)):
                await receiver.done
        finally:
            receiver.restore()
            self.remaining -= receiver.pos - pos

    async def drain(self, deadline: float) -> None:
        """Discard what is left (bounded by ``deadline`` seconds in total)."""
        async with asyncio.timeout(deadline):
            while self.remaining:
                await self._read_some(1 << 20)


@dataclass
class Request:
    header: RequestHeader
    key: bytes
    trace: str
    body: Body
    peer: str = ""
    conn_id: int = 0
    # set by the connection when the peer disconnects; long handlers watch it
    peer_gone: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def op(self) -> int:
        return self.header.op


class ResponseWriter:
    """Writes exactly one response. ``start``+``write`` for streamed payloads."""

    def __init__(self, writer: asyncio.StreamWriter):
        self._w = writer
        self.status: int | None = None
        self.meta_len = 0
        self.payload_len = 0
        self._left = 0  # payload bytes promised but not yet written
        self.close_after = False  # e.g. PIN DECODE streams end with a close
        self.streaming_eof = False  # payload_len 0 followed by frames until close

    @property
    def started(self) -> bool:
        return self.status is not None

    @property
    def complete(self) -> bool:
        return self.started and self._left == 0

    async def send(self, status: int, meta: dict | None = None, payload: bytes | memoryview = b"") -> None:
        await self.start(status, meta, len(payload))
        if payload:
            await self.write(payload)

    async def start(self, status: int, meta: dict | None, payload_len: int) -> None:
        if self.started:
            raise RuntimeError("response already started")
        m = encode_meta(meta)
        self.status, self.meta_len, self.payload_len = int(status), len(m), payload_len
        self._left = payload_len
        if payload_len >= DIRECT_MIN:
            # Fewer drain round trips for big payloads; the transport keeps references to
            # the chunks (memoryviews of the state), not copies.
            self._w.transport.set_write_buffer_limits(high=8 << 20)
        self._w.write(encode_response_header(int(status), len(m), payload_len) + m)
        if payload_len == 0:
            await self._w.drain()

    async def write(self, data: bytes | memoryview) -> None:
        if len(data) > self._left and not self.streaming_eof:
            raise RuntimeError("writing past the promised payload_len")
        if not self.streaming_eof:
            self._left -= len(data)
        if self._w.transport.is_closing():  # the client reset mid-response
            raise PeerGone("client went away during the response")
        self._w.write(data)
        await self._w.drain()

    async def drain_all(self) -> None:
        """Wait until everything written has left our buffers (not just below the high-water mark)."""
        transport = self._w.transport
        transport.set_write_buffer_limits(high=0)
        try:
            await self._w.drain()
        finally:
            transport.set_write_buffer_limits()

    async def start_eof_stream(self, status: int = Status.OK, meta: dict | None = None) -> None:
        """PIN-style stream: header with payload_len 0, frames follow, then close."""
        await self.start(status, meta, 0)
        self.streaming_eof = True
        self.close_after = True
