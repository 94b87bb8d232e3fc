"""The Hydra connection: a BufferedProtocol feeding the codec's RequestDecoder, and one task
that serves the decoded requests strictly one at a time.

The transport receives straight into the decoder's buffer (or, for a large payload a handler
reads with ``Body.read_into``, straight into the handler's buffer). The decoder owns framing
and limits; this module owns what goes on the wire when a request is refused and the timing:

* each request gets exactly one well-formed response; a refused frame (oversized field,
  unknown opcode) is answered ERROR and skipped so the next header is read from the right
  offset — bounded by ``limits.max_drain``, beyond which the connection is closed after the
  reply; bad magic closes without a reply;
* progress-based read deadlines (:mod:`hydra_rpc.hydra.deadlines`): idle between requests, stall and
  minimum rate inside a frame, counted only while the server waits for the client;
* backpressure both ways: reading pauses while a request's unread bytes pile up, and writers
  wait (``drain``) while the transport's write buffer is above its high-water mark;
* ``peer_gone`` is set when the client half-closes or goes away, so a long generation for a
  client that left can be cancelled.

Where the serving task and the client's end are lives in :mod:`hydra_rpc.hydra.conn_state`
(every move checked against its table); backpressure in :mod:`hydra_rpc.hydra.flow_control`.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Awaitable, Callable

from codec.decoder import NEED_DATA, RECV_BUFFER, PayloadChunk, RequestDecoder, RequestStart
from codec.enums import Status, op_name, status_name
from codec.errors import BadMagic, FrameTooLarge, RemoteProtocolError

from hydra_rpc.config import ServerConfig
from hydra_rpc.hydra.conn_state import (GRACEFUL_STOP, REQUEST_ENDS, REQUEST_STARTS, ConnState, Peer, Serving,
                                        serving_after)
from hydra_rpc.hydra.deadlines import IDLE, ClockTimer, ReadClock
from hydra_rpc.hydra.flow_control import FlowControl
from hydra_rpc.observability.logs import log_request, routine_level
from hydra_rpc.hydra.wire import Body, PeerGone, Request, ResponseWriter

log = logging.getLogger("hydra_rpc.connection")

Handler = Callable[[Request, ResponseWriter], Awaitable[None]]
OnRequest = Callable[[str, str, float, int, int], None]


class CloseConnection(Exception):
    """Stop serving this connection (after whatever response was already written)."""


class HydraConnection(asyncio.BufferedProtocol):
    def __init__(self, cfg: ServerConfig, handlers: dict[int, Handler], conn_id: int, peer: str,
                 on_request: OnRequest | None = None):
        self.cfg, self.handlers = cfg, handlers
        self.conn_id, self.peer = conn_id, peer
        self.on_request = on_request
        self.decoder = RequestDecoder(cfg.limits)
        # Unread bytes at which reading pauses while nothing waits for them (a handler busy before
        # it reads its payload, pipelined requests): low, so a large payload is received where the
        # handler wants it rather than piled up here. A reader waiting for more never pauses it.
        self._high_water = RECV_BUFFER
        self.clock = ReadClock(cfg.idle_timeout, cfg.stall_timeout, cfg.min_rate, cfg.min_rate_window)
        self.peer_gone = asyncio.Event()
        self.closed: asyncio.Future[bool] = asyncio.get_running_loop().create_future()  # see Request.closed
        self._reset = False  # how it ended, for ``closed``: the peer did not take everything we sent
        self.transport: asyncio.Transport | None = None
        self.state = ConnState()
        self._flow = FlowControl()
        self.requests = 0
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future | None = None  # the serving task waits here for bytes
        self._timer = ClockTimer(self.clock, self._deadline_passed)

    # ---------------------------------------------------------------- state
    def _transition(self, to: Serving | Peer) -> None:
        """The only way the state changes; raises IllegalTransition on a move not in the table."""
        self.state.move(to)
        if self.state.finished:
            self._let_go()

    @property
    def in_request(self) -> bool:
        """A request is being answered: a graceful shutdown lets it finish (HydraServer.shutdown)."""
        return self.state.in_request

    @property
    def stopping(self) -> bool:
        """Set by a graceful shutdown: finish the request in flight, then close."""
        return self.state.stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        if not value:
            if self.state.stopping:
                raise ValueError("a graceful stop cannot be taken back")
            return
        # asked twice (a second shutdown), or after serve() returned: nothing more to stop
        if not self.state.stopping and self.state.serving is not Serving.SERVED:
            self._transition(serving_after(GRACEFUL_STOP, self.state.serving))

    @property
    def _write_paused(self) -> bool:  # read by tests/test_connection_loop.py
        return self._flow.writing_paused

    # ---------------------------------------------------------------- protocol callbacks
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = self._flow.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.decoder.buffer_updated(nbytes)
        self.clock.received(nbytes, self._loop.time())
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        elif (self.decoder.buffered >= self._high_water and not self.decoder.receiving
              and self.state.writable):  # a lost transport has nothing left to pause
            self._flow.pause_reading()

    def eof_received(self) -> bool:
        self._transition(Peer.HALF_CLOSED)
        self.peer_gone.set()
        self._wake()
        return True  # keep the transport open: the responses still go out

    def connection_lost(self, exc: Exception | None) -> None:
        self._reset = self._reset or exc is not None
        self.peer_gone.set()
        self._wake()
        self._flow.fail_writers(lambda: PeerGone("client went away during the response"))
        self._timer.cancel()
        self._transition(Peer.GONE)  # lets go when already served

    def _let_go(self) -> None:
        """Served and closed (``ConnState.finished``): drop the transport and disarm the deadline
        timer. Both point back at this connection (the transport's protocol, the timer's callback),
        so kept they would make every finished connection a reference cycle of ~17 objects that
        only the cyclic GC frees — and its full collections stopped the event loop for 30–50 ms
        with 1,000 connections open (docs/performance.md, 'Per request'). Dropped, a connection
        is freed when it ends."""
        self.transport = None
        self._flow.detach()
        self._timer.disarm()

    def pause_writing(self) -> None:
        self._flow.pause_writing()

    def resume_writing(self) -> None:
        self._flow.resume_writing()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # ---------------------------------------------------------------- writing (ResponseWriter's sink)
    def write(self, data: bytes | memoryview) -> None:
        self.transport.write(data)

    async def drain(self) -> None:
        if not self.state.writable:
            raise PeerGone("client went away during the response")
        await self._flow.drain()

    # ---------------------------------------------------------------- reading
    async def _wait_data(self) -> None:
        """Wait for more bytes from the client, under the read deadlines."""
        if not self.state.readable:
            raise PeerGone("client closed the connection" if self.decoder.at_boundary and not self.decoder.buffered
                           else "client closed the connection mid-frame")
        self.clock.wait(self._loop.time(), idle=self.decoder.at_boundary and not self.decoder.buffered)
        self._timer.arm()
        self._flow.resume_reading()
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
            self.clock.stop(self._loop.time())

    def _deadline_passed(self, reason: str) -> None:
        # an idle persistent connection timing out is routine (a coordinator's pooled socket)
        level = routine_level() if reason == IDLE else logging.INFO
        log.log(level, "closing: %s", self.clock.describe(reason), extra={"fields": {"peer": self.peer, "conn": self.conn_id}})
        if reason == IDLE:
            self.transport.close()
        else:  # a client that stopped sending may not read either: do not wait to flush
            self.transport.abort()

    async def next_event(self):
        while True:
            ev = self.decoder.next_event()
            if ev is not NEED_DATA:
                return ev
            await self._wait_data()

    # PayloadSource, for Body
    async def payload_chunk(self) -> bytes:
        ev = await self.next_event()
        if not isinstance(ev, PayloadChunk):  # Body never asks past payload_len
            raise AssertionError(f"expected payload bytes, got {ev!r}")
        return ev.data

    async def payload_into(self, dest: memoryview) -> None:
        self.decoder.receive_into(dest)
        while self.decoder.receiving:
            await self._wait_data()

    async def skip_payload(self) -> None:
        """Discard the rest of the current request (bounded by ``limits.max_drain``)."""
        if self.decoder.at_boundary:
            return
        try:
            self.decoder.skip_payload()
        except FrameTooLarge as e:
            raise CloseConnection from e
        while not self.decoder.at_boundary:
            await self.next_event()

    # ---------------------------------------------------------------- serving
    async def serve(self) -> None:
        """Serve requests until the client leaves, a deadline passes or the server stops."""
        try:
            while not self.stopping:
                try:
                    ev = await self.next_event()
                except FrameTooLarge as e:
                    await self._refuse(e)
                    continue
                if isinstance(ev, RequestStart):
                    await self._one_request(ev)
                    self.clock.new_frame()
        except BadMagic as e:
            log.warning("closing: %s", e, extra={"fields": {"peer": self.peer, "conn": self.conn_id}})
        except (CloseConnection, PeerGone, ConnectionError, TimeoutError):
            pass
        finally:
            self._finish()

    async def refuse_connection(self, status: Status, body: dict) -> None:
        """Answer with ``status`` instead of serving (the connection limit: BUSY), then close as a
        served connection does — so a refused one, too, is freed as soon as it ends."""
        try:
            await ResponseWriter(self).send(status, body)
        except (PeerGone, ConnectionError):
            pass
        finally:
            self._finish()

    def _finish(self) -> None:
        self._timer.cancel()
        if self.transport is not None:
            self._reset = self._reset or (self.state.writable and _socket_error(self.transport))
            self.transport.close()
        if not self.closed.done():
            self.closed.set_result(self._reset)
        self._transition(Serving.SERVED)  # lets go when the transport is gone already

    async def _refuse(self, e: FrameTooLarge) -> None:
        """A frame the decoder refused: one ERROR, then skip it (or close, when it is too big)."""
        h = e.header
        message = (f"unknown opcode 0x{h.op:02x}" if h.op not in self.handlers and e.rule == "req.payload_len"
                   else str(e))
        resp = ResponseWriter(self)
        with self._request(h, b"", b"", resp):
            await resp.send(Status.ERROR, {"error": message} if e.recoverable else
                            {"error": message + "; too large to drain, closing the connection"})
            if not e.recoverable:
                raise CloseConnection
            await self.skip_payload()

    async def _one_request(self, start: RequestStart) -> None:
        h = start.header
        resp = ResponseWriter(self)
        with self._request(h, start.key, start.trace, resp) as trace:
            handler = self.handlers.get(h.op)
            if handler is None:
                await resp.send(Status.ERROR, {"error": f"unknown opcode 0x{h.op:02x}"})
            else:
                req = Request(h, start.key, trace, Body(self, start.payload_len), self.peer, self.conn_id,
                              self.peer_gone, self.closed)
                await self._run(handler, req, resp)
            await self.skip_payload()

    async def _run(self, handler: Handler, req: Request, resp: ResponseWriter) -> None:
        try:
            await handler(req, resp)
        except RemoteProtocolError as e:
            if resp.started:
                raise CloseConnection from e
            await resp.send(e.status, {"error": str(e), "rule": e.rule})
        except (PeerGone, ConnectionError, CloseConnection, TimeoutError, asyncio.IncompleteReadError):
            raise
        except Exception as e:  # a bug of ours: answer, log, keep the connection
            if self.peer_gone.is_set():  # not a bug: the client left and took its reply's reader with it
                log.info("client went away before its reply", extra={"fields": {
                    "op": op_name(req.op), "trace": req.trace, "error": f"{type(e).__name__}: {e}"}})
                raise CloseConnection from e
            log.exception("handler failed", extra={"fields": {"op": op_name(req.op), "trace": req.trace}})
            if resp.started:
                raise CloseConnection from e
            await resp.send(Status.ERROR, {"error": f"internal error: {type(e).__name__}: {e}"})
        if not resp.started:
            await resp.send(Status.ERROR, {"error": "handler produced no response"})
        if not resp.complete and not resp.streaming_eof:
            raise CloseConnection  # promised bytes not written: cannot stay in sync
        if resp.close_after:
            raise CloseConnection

    def _request(self, h, key: bytes, trace: bytes, resp: ResponseWriter) -> "_RequestScope":
        return _RequestScope(self, h, key, trace, resp)


def _socket_error(transport: asyncio.BaseTransport) -> bool:
    """A reset the kernel recorded but nobody read: our reply reached a socket the peer had
    already closed (its FIN came first, so reading stopped at the end of the stream)."""
    sock = transport.get_extra_info("socket")
    try:
        return sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
    except OSError:
        return False


class _RequestScope:
    """One request's bookkeeping: the serving state (``in_request``, for graceful shutdown), the
    request log line and the metrics callback, however the request ends."""

    __slots__ = ("conn", "header", "key", "trace", "resp", "started")

    def __init__(self, conn: HydraConnection, header, key: bytes, trace: bytes, resp: ResponseWriter):
        self.conn, self.header, self.key, self.resp = conn, header, key, resp
        self.trace = trace.decode("utf-8", "replace")

    def __enter__(self) -> str:
        conn = self.conn
        conn._transition(serving_after(REQUEST_STARTS, conn.state.serving))
        self.started = time.perf_counter()
        return self.trace

    def __exit__(self, *exc) -> None:
        conn, h, resp = self.conn, self.header, self.resp
        conn._transition(serving_after(REQUEST_ENDS, conn.state.serving))
        conn.requests += 1
        st = status_name(resp.status) if resp.status is not None else "NONE"
        op = op_name(h.op)
        log_request(op=op, key=self.key[:64].decode("utf-8", "replace"), trace=self.trace, status=st,
                    req_bytes=h.payload_len, resp_bytes=resp.payload_len, started=self.started, peer=conn.peer,
                    conn=conn.conn_id, rule=resp.error_rule, tokens=resp.tokens_streamed)
        if conn.on_request:
            conn.on_request(op, st, time.perf_counter() - self.started, h.payload_len, resp.payload_len)
