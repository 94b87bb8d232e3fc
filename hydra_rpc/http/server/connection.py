"""One HTTP/1.1 client connection: requests in order, responses framed, deadlines kept.

The connection reads with ``codec.http1`` and answers each request in a task of its own, one at
a time (a pipelined request waits for the one before it; more than :data:`MAX_PIPELINED`
waiting stops the reading). What it keeps for a client:

* **its place in the connection budget** — over ``--max-connections`` the client gets one
  ``503`` and a close, and nothing it sends is read;
* **the read deadlines** of the engine port (:class:`~hydra_rpc.hydra.deadlines.ReadClock`): a
  new connection must start a request within ``--first-bytes-timeout``, a kept-alive one within
  the idle timeout; a head or a body being read must not stall or fall under the minimum rate —
  counted only while the server waits for the client, never while a handler works;
* **the framing**: a body nobody read is dropped as it arrives when little is left, else the
  answer says ``Connection: close`` and the rest is read and dropped for at most
  :data:`LINGER` seconds (a client still sending would otherwise meet a reset before it reads
  the answer); a client that disconnects has its handler cancelled, which cancels its job.
"""
from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections import deque
from typing import Any

from codec.http1 import CONTINUE, END, LAST_CHUNK, HttpProtocolError, RequestHead, RequestReader, chunk, \
    http_date, response_head

from hydra_rpc.hydra.deadlines import IDLE, ClockTimer, ReadClock
from hydra_rpc.http.errors import ApiError, error_body
from hydra_rpc.http.server.messages import Body, Request, Response, StreamResponse

log = logging.getLogger("hydra_rpc.http")

MAX_PIPELINED = 16  # requests read ahead of the one being answered
DISCARD_MAX = 64 * 1024  # an unread body with at most this much still to come is dropped, not closed on
LINGER = 10.0  # seconds a closing connection reads and drops what its client still sends
REFUSAL_LINGER = 1.0  # seconds an over-limit client gets to read its 503 before the close
SERVER = "hydra-rpc"


class ConnState(enum.Enum):
    WAITING = "waiting"  # for a request: idle, or its head arriving
    HANDLING = "handling"  # a request is being answered
    LINGERING = "lingering"  # answered with a close: what the client still sends is dropped
    CLOSED = "closed"


_NEXT_STATES = {
    ConnState.WAITING: {ConnState.HANDLING, ConnState.CLOSED},
    ConnState.HANDLING: {ConnState.WAITING, ConnState.LINGERING, ConnState.CLOSED},
    ConnState.LINGERING: {ConnState.CLOSED},
    ConnState.CLOSED: set(),
}


def error_bytes(status: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A whole error answer that closes the connection (OpenAI's error object)."""
    body = json.dumps(error_body(status, message)).encode()
    return response_head(status, (("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                                  ("Connection", "close"), *headers)) + body


class HttpConnection(asyncio.Protocol):
    def __init__(self, server: Any):  # serve.HttpServer: its cfg, budget, respond, access_log
        self.server = server
        self.state = ConnState.WAITING
        self.transport: asyncio.Transport | None = None
        self.gone = False
        self.refused = False
        cfg = server.cfg
        self.clock = ReadClock(cfg.first_bytes_timeout, cfg.stall_timeout, cfg.min_rate, cfg.min_rate_window)
        self._loop = asyncio.get_running_loop()
        self._timer = ClockTimer(self.clock, self._deadline_passed)
        self._reader = RequestReader()
        self._pending: deque[Request] = deque()  # read, waiting for the one being answered
        self._receiving: Body | None = None  # the body the next bytes belong to
        self._task: asyncio.Task | None = None
        self._remote = ""
        self.peer_allowed = False
        self._reading_paused: set[str] = set()  # why the socket is not read: "body", "pipeline"
        self._write_paused = False
        self._drain: list[asyncio.Future] = []
        self._linger: asyncio.TimerHandle | None = None
        self._stream: tuple[Request, StreamResponse] | None = None  # a streamed answer whose head waits
        self._chunked = False
        self._head_only = False
        self._broken = False  # bytes that are not HTTP arrived: nothing more is read
        self.keep_alive = True

    def _move(self, to: ConnState) -> None:
        if to not in _NEXT_STATES[self.state]:
            raise RuntimeError(f"HTTP connection: no transition {self.state.value} -> {to.value}")
        self.state = to

    # ---------------------------------------------------------------- transport events
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        server = self.server
        if server.budget.over_limit:
            self.refused = True
            transport.write(error_bytes(503, f"connection limit of {server.budget.max_connections} reached; "
                                             "retry later", (("Retry-After", "1"),)))
            self._linger = self._loop.call_later(REFUSAL_LINGER, transport.close)
            return
        peer = transport.get_extra_info("peername")
        self._remote = str(peer[0]) if isinstance(peer, tuple) else ""
        self.peer_allowed = server.cfg.peer_allowed(self._remote)  # --allow: each request answers 403 if not
        server.connections.add(self)
        self._wait(idle=True)

    def data_received(self, data: bytes) -> None:
        if self.refused or self._broken or self.state is ConnState.LINGERING:
            return  # not read: dropped
        self.clock.received(len(data), self._loop.time())
        if self.clock.waiting:
            self._timer.arm()  # the first byte of a request turns the idle deadline into stall and rate
        try:
            events = self._reader.feed(data)
        except HttpProtocolError as e:
            self._protocol_error(e)
            return
        for event in events:
            if isinstance(event, RequestHead):
                self._request_arrived(event)
            elif event is END:
                if self._receiving is not None:
                    self._receiving.end()
                    self._receiving = None
            elif self._receiving is not None:
                self._receiving.feed(event)  # type: ignore[arg-type]

    def eof_received(self) -> bool | None:
        # as aiohttp: the client's end closes the connection, which cancels its handler (a
        # client that gave up waiting frees its slot); a half-closed client is not answered
        if self._receiving is not None:
            self._receiving.fail(ConnectionResetError("the client closed before its body ended"))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.gone:
            return
        self.gone = True
        self.server.budget.closed()
        if self._linger is not None:
            self._linger.cancel()
        if self.refused:
            return
        self.state = ConnState.CLOSED
        self.server.connection_gone(self)
        if self._receiving is not None:
            self._receiving.fail(ConnectionResetError("the client closed the connection"))
        self._pending.clear()
        self._wake_drain(ConnectionResetError("the client closed the connection"))
        if self._task is not None and not self._task.done():
            self._task.cancel()
        # the timer's callback is this connection: kept armed, they would stay a cycle
        self._timer.disarm()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain(None)

    # ---------------------------------------------------------------- requests
    def _request_arrived(self, head: RequestHead) -> None:
        request = Request(head, self, Body(self, head.expect_continue), self._remote)
        if head.has_body:
            self._receiving = request.body
        else:
            request.body.end()
        if self.state is ConnState.WAITING and self._task is None:
            self._start(request)
        else:
            self._pending.append(request)
            if len(self._pending) >= MAX_PIPELINED:
                self._pause_reading("pipeline")

    def _start(self, request: Request) -> None:
        self._move(ConnState.HANDLING)
        now = self._loop.time()
        self.clock.stop(now)  # the handler works: not the client's time
        self.clock.new_frame()
        self._task = self._loop.create_task(self._answer(request))

    async def _answer(self, request: Request) -> None:
        t0 = time.perf_counter()
        status, sent = 499, 0
        try:
            response = await self.server.respond(request)
            status = response.status
            if isinstance(response, Response):
                sent = self._send_whole(request, response)
            else:
                if not response.prepared:
                    await response.prepare(request)
                await response.write_eof()
                sent = response.body_length
        except (asyncio.CancelledError, ConnectionResetError):
            self.abort()  # the client left (else: nothing sane is left to answer on this stream)
            return
        except Exception:  # a response this connection cannot send: the stream is not to be trusted
            log.exception("HTTP %s %s: the answer could not be sent", request.method, request.path)
            self.abort()
            return
        finally:
            self.server.access_log(request, status, sent, time.perf_counter() - t0)
            self._task = None
        self._answered(request)

    def _keep_alive(self, request: Request) -> bool:
        """Whether the connection outlives this answer (decided before its head is written)."""
        body = request.body
        if not (self.keep_alive and request.head.keep_alive and not self.server.closing):
            return False
        if body.eof:
            return True
        if request.head.chunked or (request.head.expect_continue and not body.continued):
            return False  # an unknown rest, or a client waiting for a 100 it will not get
        return (request.head.content_length or 0) - body.received <= DISCARD_MAX

    def _answered(self, request: Request) -> None:
        if self.gone:
            return
        body = request.body
        if not body.eof:
            body.discard = True  # the rest is dropped as it arrives; the framing is still read
            self._resume_reading("body")
        if not self.keep_alive or self.server.closing:  # closing: the head may have said keep-alive
            if body.eof:
                self._close()
            else:
                self._linger_then_close()
            return
        self._move(ConnState.WAITING)
        self.clock.idle_timeout = self.server.idle_timeout
        if self._pending:
            self._resume_reading("pipeline")
            self._start(self._pending.popleft())
        else:
            self._wait(idle=True)

    # ---------------------------------------------------------------- writing
    def _head(self, request: Request, status: int, headers: dict[str, str], length: int | None) -> bytes:
        self.keep_alive = self._keep_alive(request)
        fields = [*headers.items(), ("Date", http_date()), ("Server", SERVER)]
        if length is not None:
            fields.append(("Content-Length", str(length)))
        elif request.head.version == "1.1":
            fields.append(("Transfer-Encoding", "chunked"))
        else:
            self.keep_alive = False  # HTTP/1.0 without a length: the close ends the body
        if not self.keep_alive:
            fields.append(("Connection", "close"))
        elif request.head.version == "1.0":
            fields.append(("Connection", "keep-alive"))
        return response_head(status, fields)

    def _send_whole(self, request: Request, response: Response) -> int:
        body = response.body
        head = self._head(request, response.status, response.headers, len(body))
        if request.method == "HEAD":
            body = b""
        if len(body) < 16384:  # one send; a large body is not copied to join it
            self._write(head + body)
        else:
            self._write(head)
            self._write(body)
        return len(body)

    def _write(self, data: bytes) -> None:
        if self.gone or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)

    async def drain(self) -> None:
        if self._write_paused and not self.gone:
            waiter = self._loop.create_future()
            self._drain.append(waiter)
            await waiter

    def _wake_drain(self, error: BaseException | None) -> None:
        waiters, self._drain = self._drain, []
        for w in waiters:
            if not w.done():
                w.set_exception(error) if error is not None else w.set_result(None)

    def start_stream(self, request: Request, response: StreamResponse) -> None:
        self._stream = (request, response)  # the head leaves with the first piece

    def _stream_head(self, response: StreamResponse) -> bytes:
        if self._stream is None or self._stream[1] is not response:
            return b""
        request, _ = self._stream
        self._stream = None
        head = self._head(request, response.status, response.headers, response.content_length)
        self._chunked = response.content_length is None and request.head.version == "1.1"
        self._head_only = request.method == "HEAD"
        return head

    def stream_send(self, response: StreamResponse, data: bytes) -> None:
        head = self._stream_head(response)
        if self._head_only:
            if head:
                self._write(head)
            return
        self._write(head + (chunk(data) if self._chunked else data))

    async def stream_end(self, response: StreamResponse) -> None:
        head = self._stream_head(response)
        tail = LAST_CHUNK if self._chunked and not self._head_only else b""
        if response.content_length is not None and response.body_length != response.content_length:
            self.keep_alive = False  # the body is not what its head said: the close ends it
        if head or tail:
            self._write(head + tail)
        await self.drain()

    def send_continue(self) -> None:
        if not self.gone and not self.transport.is_closing():
            self.transport.write(CONTINUE)

    # ---------------------------------------------------------------- reading
    def body_too_large(self, body: Body) -> None:
        body.fail(ApiError(413, f"request body too large: more than the limit of {body.limit} bytes"))

    def pause_reading_body(self) -> None:
        self._pause_reading("body")

    def resume_reading_body(self) -> None:
        self._resume_reading("body")

    def _pause_reading(self, why: str) -> None:
        if not self._reading_paused and not self.gone:
            self.transport.pause_reading()
        self._reading_paused.add(why)

    def _resume_reading(self, why: str) -> None:
        if why in self._reading_paused:
            self._reading_paused.discard(why)
            if not self._reading_paused and not self.gone:
                self.transport.resume_reading()

    def reading_body(self, reading: bool) -> None:
        """A handler waits for its body (True) or has it (False): the deadlines run meanwhile."""
        now = self._loop.time()
        if reading:
            self.clock.wait(now, idle=False)
            self._timer.arm()
        else:
            self.clock.stop(now)

    # ---------------------------------------------------------------- closing
    def _wait(self, idle: bool) -> None:
        self.clock.wait(self._loop.time(), idle=idle)
        self._timer.arm()

    def close_idle(self) -> bool:
        """Close the connection if no request is in it (a server shutting down); True if closed."""
        if self.state is ConnState.WAITING and self._task is None and not self._reader.in_head:
            self._close()
            return True
        return False

    def _close(self) -> None:
        if not self.gone and self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if not self.gone and self.transport is not None:
            self.transport.abort()

    def _linger_then_close(self) -> None:
        self._move(ConnState.LINGERING)
        self._resume_reading("body")
        self._resume_reading("pipeline")
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the answer is out; what the client still sends is dropped
        self._linger = self._loop.call_later(LINGER, self._close)

    def _protocol_error(self, e: HttpProtocolError) -> None:
        """Bytes that are not a request: a 4xx and a close, after the answer in progress."""
        self.server.bad_requests.warn(log, "bad HTTP request from %s: %d %s", self._remote, e.status, e)
        self._broken = True
        self.keep_alive = False
        self._pending.clear()
        if self._receiving is not None:  # a body being read broke off: its handler answers the error
            self._receiving.fail(ApiError(e.status, str(e)))
            self._receiving = None
        if self._task is None:
            self.transport.write(error_bytes(e.status, str(e)))
            self._close()

    def _deadline_passed(self, reason: str) -> None:
        if self.gone:
            return
        log.info("closing HTTP connection from %s: %s", self._remote, self.clock.describe(reason))
        if reason == IDLE:
            self.transport.close()
        else:  # a client that stopped sending may not read either: do not wait to flush
            self.transport.abort()

