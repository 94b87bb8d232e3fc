"""HTTP/1.1 on the HTTP side's connections, sans-IO: request bytes in, events out; response
heads and chunks as bytes.

The request parser is llhttp (Node's parser, through ``httptools``; aiohttp's C parser is the
same one): it frames bodies by ``Content-Length`` or chunked encoding and refuses what would let
two servers read one stream differently (both framings at once, a bad length, a bad chunk
size). What llhttp leaves to its user is checked here, before anything grows: the size of a
request's head and of each of its lines, the number of headers, and what a chunked body sends
beside its data — trailers, chunk extensions (each a ``431``); the
request target's length (``414``), and how many requests one read may pipeline (``429``: a
read of 256 KiB holds thousands of minimal requests, each a few objects until answered).

:meth:`RequestReader.feed` returns, in order, for every request in the bytes given (clients
may pipeline): a :class:`RequestHead`, its body as ``bytes`` pieces, and :data:`END`.
"""
from __future__ import annotations

import email.utils
import http
import time
from typing import Iterable, Union
from urllib.parse import unquote

import httptools

MAX_TARGET = 8190  # a request target longer than this: 414 (aiohttp's and cpp-httplib's line limit)
MAX_FIELD = 8190  # a header's name or value
MAX_HEADERS = 100  # cpp-httplib's CPPHTTPLIB_HEADER_MAX_COUNT
MAX_HEAD = 64 * 1024  # a request's whole head
MAX_REQUESTS_PER_FEED = 64  # pipelined requests in one read: each is objects held until answered

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"


class HttpProtocolError(Exception):
    """The client's bytes are not an HTTP/1.1 request this server reads: answered with
    ``status`` and a close (the stream cannot be trusted past them)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Headers:
    """A request's headers, looked up by name in any case; a repeated header's values are
    joined with ", " (RFC 9110 §5.3), as every reader of ours takes one value."""

    __slots__ = ("_by_name", "raw")

    def __init__(self, raw: list[tuple[str, str]]):
        self.raw = raw
        by_name: dict[str, str] = {}
        for name, value in raw:
            key = name.lower()
            by_name[key] = f"{by_name[key]}, {value}" if key in by_name else value
        self._by_name = by_name

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._by_name.get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return self._by_name[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._by_name

    def items(self) -> Iterable[tuple[str, str]]:
        return iter(self.raw)


class RequestHead:
    """A request's line and headers. ``path`` is percent-decoded; ``target`` as sent."""

    __slots__ = ("method", "target", "path", "query_string", "version", "headers", "keep_alive",
                 "content_length", "chunked", "expect_continue", "upgrade")

    def __init__(self, method: str, target: str, version: str, headers: Headers, keep_alive: bool, upgrade: bool):
        self.method, self.target, self.version, self.headers = method, target, version, headers
        path, _, query = target.partition("?")
        self.path = unquote(path.partition("#")[0])
        self.query_string = query.partition("#")[0]
        self.keep_alive = keep_alive and not upgrade  # an upgrade this server does not make ends the stream
        self.upgrade = upgrade
        length = headers.get("content-length")
        self.content_length = int(length) if length is not None else None  # llhttp checked the digits
        self.chunked = "chunked" in (headers.get("transfer-encoding") or "").lower()
        self.expect_continue = (headers.get("expect") or "").lower() == "100-continue" and version == "1.1"

    @property
    def has_body(self) -> bool:
        return self.chunked or bool(self.content_length)


class _End:
    def __repr__(self) -> str:
        return "END"


END = _End()  # a request's body is complete
Event = Union[RequestHead, bytes, _End]


class RequestReader:
    """Requests from a client's bytes (llhttp's callbacks collected into events)."""

    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._events: list[Event] = []
        self._target = bytearray()
        self._headers: list[tuple[str, str]] = []
        self._head_bytes = 0
        self._begun = 0  # requests begun in the current feed
        self.in_head = False  # between a request's first byte and its head's end
        # a body's bytes that are neither data nor a chunk's size line, read since either: the
        # last chunk's trailers (llhttp keeps a trailer line until it ends, as a head's) or a
        # chunk extension that never ends — counted as they arrive
        self._in_body = False
        self._quiet_bytes = 0
        self._moved = False  # data, a chunk or an end arrived in the current feed
        self.upgraded = False  # llhttp stopped: what follows is not HTTP/1.1

    def feed(self, data: bytes) -> list[Event]:
        if self.upgraded:
            return []
        in_head_before = self.in_head  # a head that began in an earlier feed: all of data counts
        in_body_before = self._in_body
        self._begun, self._moved = 0, False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.upgraded = True  # the head went out as an event with upgrade set
        except httptools.HttpParserCallbackError as e:
            raise (e.__context__ if isinstance(e.__context__, HttpProtocolError) else
                   HttpProtocolError(400, f"malformed request: {e}")) from None
        except httptools.HttpParserError as e:
            raise HttpProtocolError(400, f"malformed request: {e}") from None
        if self.in_head:
            # llhttp keeps a header line until it ends: counted here as it arrives (a head
            # that began in this feed counts its complete lines; the rest the next feed counts)
            if in_head_before and not self._events:
                self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD:
                raise HttpProtocolError(431, f"request head larger than {MAX_HEAD} bytes")
        if in_body_before and self._in_body and not self._moved:  # no data, no chunk, no end
            self._quiet_bytes += len(data)
            if self._quiet_bytes > MAX_HEAD:
                raise HttpProtocolError(431, f"a chunk's size line or the trailers longer than {MAX_HEAD} bytes")
        events, self._events = self._events, []
        return events

    # ---------------------------------------------------------------- llhttp's callbacks
    def on_message_begin(self) -> None:
        self._begun += 1
        if self._begun > MAX_REQUESTS_PER_FEED:
            raise HttpProtocolError(429, f"more than {MAX_REQUESTS_PER_FEED} requests pipelined in one read")
        self.in_head, self._head_bytes = True, 0
        self._target.clear()
        self._headers = []

    def on_url(self, part: bytes) -> None:
        self._target += part
        self._head_bytes += len(part)
        if len(self._target) > MAX_TARGET:
            raise HttpProtocolError(414, f"request target longer than {MAX_TARGET} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) > MAX_FIELD or len(value) > MAX_FIELD:
            raise HttpProtocolError(431, f"a header line longer than {MAX_FIELD} bytes")
        if len(self._headers) >= MAX_HEADERS:
            raise HttpProtocolError(431, f"more than {MAX_HEADERS} headers")
        self._head_bytes += len(name) + len(value) + 4
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        p = self._parser
        self.in_head, self._in_body = False, True
        self._events.append(RequestHead(p.get_method().decode("ascii"), self._target.decode("latin-1"),
                                        p.get_http_version(), Headers(self._headers), p.should_keep_alive(),
                                        p.should_upgrade()))

    def on_body(self, data: bytes) -> None:
        self._moved, self._quiet_bytes = True, 0
        self._events.append(data)

    def on_chunk_header(self) -> None:
        self._moved, self._quiet_bytes = True, 0

    def on_message_complete(self) -> None:
        self._in_body = False
        self._events.append(END)


# ---------------------------------------------------------------- responses
_REASONS = {s.value: s.phrase for s in http.HTTPStatus}
_date_second = -1
_date_header = ""


def http_date() -> str:
    """The ``Date`` header's value, formatted once a second."""
    global _date_second, _date_header
    now = int(time.time())
    if now != _date_second:
        _date_second, _date_header = now, email.utils.formatdate(now, usegmt=True)
    return _date_header


def response_head(status: int, headers: Iterable[tuple[str, str]]) -> bytes:
    """A response's status line and headers. A value with a line break is refused: a header
    never carries a client's text past its line."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
    for name, value in headers:
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"a line break in the response header {name[:40]!r}")
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


def chunk(data: bytes) -> bytes:
    """``data`` as one piece of a chunked body (never empty: that is the last chunk)."""
    return b"%x\r\n%s\r\n" % (len(data), data)
