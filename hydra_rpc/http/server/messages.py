"""A request as a handler sees it, its body as it arrives, and the two kinds of response.

The connection (``server.connection``) owns the bytes: a :class:`Request` reads its body
through a :class:`Body` the connection fills, and a response's bytes are framed and written by
the connection — handlers never touch the transport's framing.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Mapping
from urllib.parse import parse_qsl

from codec.http1 import RequestHead


BODY_HIGH_WATER = 1 << 20  # body bytes waiting for a reader before the socket stops being read


class Body:
    """One request's body, pushed by the connection as it arrives, taken by the handler.

    ``limit``: more than this many bytes (a chunked body that kept growing) fails the read
    with a 413 and drops what arrives after. ``discard``: nobody will read it (the handler
    answered without it): what arrives is dropped, the framing still followed."""

    __slots__ = ("conn", "limit", "received", "eof", "discard", "expect_continue", "continued", "_chunks",
                 "_buffered", "_waiter", "_error")

    def __init__(self, conn: Any, expect_continue: bool = False):
        self.conn, self.limit = conn, None
        self.expect_continue, self.continued = expect_continue, False
        self.received = 0
        self.eof = False
        self.discard = False
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self._error: BaseException | None = None

    # ---------------------------------------------------------------- the connection's side
    def feed(self, data: bytes) -> None:
        self.received += len(data)
        if self.discard or self._error is not None:
            return
        if self.limit is not None and self.received > self.limit:
            self.conn.body_too_large(self)
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > BODY_HIGH_WATER:
            self.conn.pause_reading_body()
        self._wake()

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        if self.received > limit:
            self.conn.body_too_large(self)

    def end(self) -> None:
        self.eof = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._chunks.clear()
        self._buffered = 0
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # ---------------------------------------------------------------- the handler's side
    @property
    def complete(self) -> bool:
        """Every byte has arrived and nothing failed the body: reading it will not wait."""
        return self.eof and self._error is None

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _take(self) -> bytes:
        data = b"".join(self._chunks) if len(self._chunks) != 1 else self._chunks[0]
        self._chunks.clear()
        self._buffered = 0
        self.conn.resume_reading_body()
        return data

    async def read_any(self) -> bytes:
        """What has arrived (waiting for some), ``b""`` at the end."""
        while True:
            if self._error is not None:
                raise self._error
            if self._chunks:
                return self._take()
            if self.eof:
                return b""
            if self.expect_continue and not self.continued:
                self.continued = True  # the client waits for this before it sends the body
                self.conn.send_continue()
            await self._wait()

    async def iter_any(self) -> AsyncIterator[bytes]:
        while data := await self.read_any():
            yield data

    async def read_all(self) -> bytes:
        parts = []
        while data := await self.read_any():
            parts.append(data)
        return b"".join(parts)


class Request:
    """The parts of a request a handler reads (named as aiohttp names them)."""

    __slots__ = ("head", "conn", "body", "match_info", "remote", "_query", "_read")

    def __init__(self, head: RequestHead, conn: Any, body: Body, remote: str):
        self.head, self.conn, self.body, self.remote = head, conn, body, remote
        self.match_info: dict[str, str] = {}  # the path's ``{name}`` values, set when routed
        self._query: dict[str, str] | None = None
        self._read: bytes | None = None

    method = property(lambda self: self.head.method)
    path = property(lambda self: self.head.path)
    headers = property(lambda self: self.head.headers)
    content_length = property(lambda self: self.head.content_length)
    body_exists = property(lambda self: self.head.has_body)
    content = property(lambda self: self.body)

    @property
    def path_qs(self) -> str:
        return self.head.target

    @property
    def query(self) -> dict[str, str]:
        """The query's first value of each name, percent-decoded."""
        if self._query is None:
            self._query = {}
            for k, v in parse_qsl(self.head.query_string, keep_blank_values=True):
                self._query.setdefault(k, v)
        return self._query

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.conn.transport if not self.conn.gone else None

    async def read(self) -> bytes:
        """The whole body (the connection has usually read it before the handler ran)."""
        if self._read is None:
            self._read = await self.body.read_all()
        return self._read


class Response:
    """A response whose body is known whole."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, body: bytes = b"", status: int = 200, headers: Mapping[str, str] | None = None,
                 content_type: str | None = None):
        self.status, self.body = status, body
        self.headers = dict(headers) if headers else {}
        if content_type is not None:
            self.headers["Content-Type"] = content_type

    @property
    def body_length(self) -> int:
        return len(self.body)


class StreamResponse:
    """A response written piece by piece: :meth:`prepare`, :meth:`write` … :meth:`write_eof`.

    The head waits for the first piece and leaves with it: one send and one wake-up of the
    client for the first token instead of two. Without ``content_length`` the body is chunked."""

    def __init__(self, status: int = 200, headers: Mapping[str, str] | None = None):
        self.status = status
        self.headers = dict(headers) if headers else {}
        self.content_length: int | None = None
        self.body_length = 0
        self.prepared = False
        self.finished = False
        self._conn: Any = None

    async def prepare(self, request: Request) -> None:
        if not self.prepared:
            self.prepared = True
            self._conn = request.conn
            self._conn.start_stream(request, self)

    async def write(self, data: bytes) -> None:
        self.send(data)
        await self.drain()

    def send(self, data: bytes) -> None:
        """Hand ``data`` to the transport without waiting for the client to take it."""
        if self._conn is None:
            raise RuntimeError("send() before prepare()")
        if data:
            self.body_length += len(data)
            self._conn.stream_send(self, data)

    async def drain(self) -> None:
        """Wait while the client is behind (the transport's buffer above its high-water mark)."""
        if self._conn is not None:
            await self._conn.drain()

    async def write_eof(self) -> None:
        if self._conn is not None and not self.finished:
            self.finished = True
            await self._conn.stream_end(self)
