"""What a handler sees of one request: the parsed head, a bounded body reader and
a response writer that guarantees exactly one well-formed response.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass, field
from typing import Callable, Protocol

from codec.enums import Status
from codec.framing import RequestHeader, encode_response_header
from codec.payloads import encode_meta

BIG_RESPONSE = 4 << 20  # responses from this size get a larger write buffer (fewer drain round trips)
# Kernel send buffer of a token stream: a client that stops reading is noticed (and its job
# paused, see ``JobHandle.set_client_blocked``) after about this much, not after the megabytes an
# autotuned loopback/LAN send buffer takes on. Token streams need no more.
STREAM_SNDBUF = 64 << 10


def client_behind(transport: asyncio.WriteTransport) -> bool:
    """The transport holds more than its high-water mark: flow control paused it, the peer is
    not taking our bytes (a drain now waits for the client)."""
    return transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]


def limit_send_buffer(transport: asyncio.BaseTransport) -> None:
    """Give a token stream's socket the small send buffer ``STREAM_SNDBUF``."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)


class PeerGone(ConnectionError):
    """The client closed or reset the connection while its request was running."""


class Body:
    """The request payload, read on demand from the connection's decoder, never beyond
    ``payload_len`` (``length``). Deadlines while waiting for the client are the connection's
    (progress-based: stall and minimum rate), not a total per read."""

    def __init__(self, conn: "PayloadSource", length: int):
        self._conn = conn
        self.length = length
        self.remaining = length  # bytes not yet handed to the handler
        self._held = memoryview(b"")  # the part of a received chunk not handed out yet

    async def _chunk(self) -> memoryview:
        if self._held:
            out, self._held = self._held, memoryview(b"")
            return out
        return memoryview(await self._conn.payload_chunk())

    async def read_exactly(self, n: int) -> bytes:
        if n > self.remaining:
            raise ValueError("read past the end of the payload")
        if n == 0:
            return b""
        parts: list[memoryview] = []  # memory follows what arrives: a length is only a claim
        need = n
        while need:
            c = await self._chunk()
            if len(c) > need:
                self._held, c = c[need:], c[:need]
            parts.append(c)
            need -= len(c)
        self.remaining -= n
        if len(parts) == 1 and isinstance(parts[0].obj, bytes) and len(parts[0].obj) == n:
            return parts[0].obj  # the decoder's whole small payload, as it is
        return b"".join(parts)

    async def read_all(self) -> bytes:
        """The whole rest of the payload (the caller has checked the size against its limit)."""
        return await self.read_exactly(self.remaining)

    async def read_into(self, buf: bytearray | memoryview) -> None:
        """Fill ``buf`` (len ≤ remaining) with the next payload bytes. What the connection has not
        received yet is received straight into ``buf`` (no intermediate copies)."""
        mv = memoryview(buf).cast("B")
        if len(mv) > self.remaining:
            raise ValueError("read past the end of the payload")
        pos = min(len(self._held), len(mv))
        mv[:pos] = self._held[:pos]
        self._held = self._held[pos:]
        if pos < len(mv):
            await self._conn.payload_into(mv[pos:])
        self.remaining -= len(mv)

    async def drain(self, deadline: float | None = None) -> None:
        """Discard what is left (the connection's drain bound applies)."""
        self._held = memoryview(b"")
        self.remaining = 0
        async with asyncio.timeout(deadline):
            await self._conn.skip_payload()


class PayloadSource(Protocol):
    """What a :class:`Body` reads from: the connection's decoder, waiting for the client."""

    async def payload_chunk(self) -> bytes: ...

    async def payload_into(self, dest: memoryview) -> None: ...

    async def skip_payload(self) -> None: ...


class ByteSink(Protocol):
    """What a :class:`ResponseWriter` writes to (the connection; a StreamWriter also fits)."""

    transport: asyncio.WriteTransport

    def write(self, data: bytes | memoryview) -> None: ...

    async def drain(self) -> None: ...


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
    # resolved when the connection has ended: True if the peer reset it, i.e. it did not take
    # everything we sent (a client that closes with our reply unread) — work left running for
    # it (a merged DECODE) has nobody to report to
    closed: asyncio.Future | None = None

    @property
    def op(self) -> int:
        return self.header.op


class ResponseWriter:
    """Writes exactly one response. ``start``+``write`` for streamed payloads."""

    def __init__(self, writer: ByteSink):
        self._w = writer
        self.status: int | None = None
        self.meta_len = 0
        self.payload_len = 0
        self._left = 0  # payload bytes promised but not yet written
        self.close_after = False  # e.g. PIN DECODE streams end with a close
        self.streaming_eof = False  # payload_len 0 followed by frames until close
        self.error_rule: str | None = None  # why a non-OK reply was sent, for the request log line
        self.tokens_streamed: int | None = None  # pieces sent by a PIN stream, for the request log line
        # told True while a write waits on a client that is not reading, then False
        self.client_wait: Callable[[bool], None] | None = None

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
        if self._w.transport.is_closing():  # the client left while its request ran (a refused STATE_PUT)
            raise PeerGone("client went away before the response")
        m = encode_meta(meta)
        self.status, self.meta_len, self.payload_len = int(status), len(m), payload_len
        if status != Status.OK and meta:
            self.error_rule = str(meta.get("rule") or meta.get("error") or "")[:200] or None
        self._left = payload_len
        if payload_len >= BIG_RESPONSE:
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
        if self.client_wait is None or not client_behind(self._w.transport):
            await self._w.drain()
            return
        self.client_wait(True)
        try:
            await self._w.drain()
        finally:
            self.client_wait(False)

    async def drain_all(self) -> None:
        """Wait until everything written has left our buffers (not just below the high-water mark)."""
        transport = self._w.transport
        transport.set_write_buffer_limits(high=0)
        try:
            await self._w.drain()
        finally:
            transport.set_write_buffer_limits()

    async def start_eof_stream(self, status: int = Status.OK, meta: dict | None = None,
                               client_wait: Callable[[bool], None] | None = None) -> None:
        """PIN-style stream: header with payload_len 0, frames follow, then close. ``client_wait``
        is told when a write waits on a client that is not reading (see ``STREAM_SNDBUF``)."""
        limit_send_buffer(self._w.transport)
        self.client_wait = client_wait
        await self.start(status, meta, 0)
        self.streaming_eof = True
        self.close_after = True
        self.tokens_streamed = 0
