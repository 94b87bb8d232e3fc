"""What one HTTP client may hold: a place in the shared connection budget, time, and memory.

aiohttp by itself closes nothing that sends nothing (its keep-alive timer is an hour), lets a
client take an hour over its headers, and buffers a request body as slowly as it arrives. Here:

* **connections** — counted with the engine port's (``conn_budget``); over ``--max-connections``
  the client gets one ``503`` and a close, before aiohttp sees a byte; at the ceiling the socket
  stops accepting;
* **deadlines** — the engine port's, with the same flags (:class:`~hydra_rpc.hydra.deadlines.ReadClock`):
  a new connection must start a request within ``--first-bytes-timeout`` and a kept-alive one
  within ``--idle-timeout``; headers and body must not stall for ``--stall-timeout`` and must
  average ``--min-rate`` over every ``--min-rate-window`` — only while the server waits for the
  client, never while a handler works. A client that misses one is closed;
* **body size** — read before the handler runs, refused from ``Content-Length`` or, for a chunked
  body, as soon as what arrived passes the limit (``413``; the rest is read and dropped). The
  default limit follows the context a request can fill: ``n_ctx_slot`` × 256 bytes, at least
  1 MiB and at most the Hydra prompt cap (64 MiB); ``HYDRA_HTTP_MAX_BODY`` overrides it. A route
  marked :func:`streams_body` (a KV state PUT: up to the STATE_PUT cap, into the resident
  buffer) checks its own size and reads its body as it arrives, inside :func:`reading_body`,
  under the same deadlines.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, Iterator

from aiohttp import web

from codec.limits import HYDRA_MAX_PROMPT_BYTES
from engine.kv_layout import slot_context
from engine.model_params import ModelParams
from engine.params_table import MAX_CTX

from hydra_rpc.config import ServerConfig
from hydra_rpc.conn_budget import Acceptor, ConnectionBudget
from hydra_rpc.hydra.deadlines import IDLE, ClockTimer, ReadClock
from hydra_rpc.http.errors import error_body

log = logging.getLogger("hydra_rpc.http")

BODY_BYTES_PER_TOKEN = 256
MIN_MAX_BODY = 1 << 20
REFUSAL_LINGER = 1.0  # seconds an over-limit client gets to read its 503 before the close


def max_body_for(params: ModelParams) -> int:
    """The default request body limit for the slot context ``params`` ask for (llama-server's
    rule; a context the model sets, ``n_ctx`` 0, is taken as the largest there is)."""
    n_ctx_slot = slot_context(params.n_ctx, params.n_slots, params.kv_unified, n_ctx_train=MAX_CTX,
                              kv_unified_per_slot=params.n_ctx_slot_cap).n_ctx_slot
    return min(HYDRA_MAX_PROMPT_BYTES, max(MIN_MAX_BODY, n_ctx_slot * BODY_BYTES_PER_TOKEN))


_GUARD = web.RequestKey("hydra_http_guard", object)


def streams_body(handler: Any) -> Any:
    """Mark a route handler that reads its own body, as it arrives and under its own size cap."""
    handler.streams_body = True
    return handler


@contextlib.contextmanager
def reading_body(request: web.Request) -> Iterator[None]:
    """A :func:`streams_body` handler reads its body in here: the read deadlines run meanwhile."""
    guard = request.get(_GUARD)
    if guard is not None:
        guard.reading_body(True)
    try:
        yield
    finally:
        if guard is not None:
            guard.reading_body(False)


def _refusal_bytes(max_connections: int) -> bytes:
    body = json.dumps(error_body(503, f"connection limit of {max_connections} reached; retry later")).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


class HttpLimits:
    """The limits of one HTTP side: its sites' connections and its app's middleware share it."""

    def __init__(self, cfg: ServerConfig, budget: ConnectionBudget, max_body: int):
        self.cfg = cfg
        self.budget = budget
        self.max_body = max_body
        self._guards: dict[Any, _Guard] = {}  # aiohttp's RequestHandler → the guard around it

    def site(self, runner: web.BaseRunner, host: str, port: int) -> "LimitedSite":
        return LimitedSite(runner, host, port, self)

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """The body is read here, under the read deadlines and the size limit; the handler then
        finds it in memory. The connection's clock stops while the handler works."""
        guard = self._guards.get(request.protocol)
        if guard is not None:
            guard.request_started()
            request[_GUARD] = guard
        try:
            if getattr(request.match_info.handler, "streams_body", False):
                return await handler(request)
            # Refused bodies are not kept: after the 413 aiohttp reads what is left and drops it,
            # for at most its lingering time, then closes.
            limit = self.max_body
            if request.content_length is not None and request.content_length > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
            if request.body_exists:
                with reading_body(request):
                    await request.read()  # aiohttp counts a chunked body against the limit as it arrives
            return await handler(request)
        finally:
            if guard is not None:
                guard.request_done()


class LimitedSite(web.BaseSite):
    """``web.TCPSite`` with the budget's accept loop and a :class:`_Guard` around each connection."""

    __slots__ = ("_host", "_port", "_limits")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, limits: HttpLimits):
        super().__init__(runner, backlog=1024)
        self._host, self._port, self._limits = host, port, limits

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server, limits = self._runner.server, self._limits
        self._server = Acceptor.listen(self._host, self._port, lambda: _Guard(server, limits), limits.budget,
                                       self._backlog)


class _Guard(asyncio.Protocol):
    """Sits between the transport and aiohttp's RequestHandler: counts the connection, refuses
    it over the limit, and enforces the read deadlines."""

    def __init__(self, make_handler, limits: HttpLimits):
        self.limits = limits
        self._make_handler = make_handler
        self.inner: Any = None
        self.transport: asyncio.Transport | None = None
        cfg = limits.cfg
        self.clock = ReadClock(cfg.first_bytes_timeout, cfg.stall_timeout, cfg.min_rate, cfg.min_rate_window)
        self._loop = asyncio.get_running_loop()
        self._timer = ClockTimer(self.clock, self._deadline_passed)
        self._refusal: asyncio.TimerHandle | None = None
        self._gone = False

    # ---------------------------------------------------------------- transport → aiohttp
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        limits = self.limits
        if limits.budget.over_limit:
            transport.write(_refusal_bytes(limits.budget.max_connections))
            self._refusal = self._loop.call_later(REFUSAL_LINGER, transport.close)
            return
        self.inner = self._make_handler()
        limits._guards[self.inner] = self
        self.inner.connection_made(transport)
        self._wait(idle=True)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return  # refused: what it sends is not read
        self.clock.received(len(data), self._loop.time())
        if self.clock.waiting:
            self._timer.arm()  # the first byte of a request turns the idle deadline into stall and rate
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.inner is None:
            self.transport.close()
            return None
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._gone:
            return
        self._gone = True
        if self._refusal is not None:
            self._refusal.cancel()
        self.limits.budget.closed()
        if self.inner is not None:
            self.limits._guards.pop(self.inner, None)
            self.inner.connection_lost(exc)
        # the timer's callback is this guard: armed, guard, aiohttp's handler and the transport
        # (16 objects) would stay a cycle; the middleware may still mark phases (arm: no-op)
        self._timer.disarm()

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # ---------------------------------------------------------------- request phases (middleware)
    def request_started(self) -> None:
        """Headers complete: the handler runs, the clock stops."""
        self.clock.stop(self._loop.time())
        self.clock.new_frame()

    def reading_body(self, reading: bool) -> None:
        now = self._loop.time()
        if reading:
            self.clock.wait(now, idle=False)
            self._timer.arm()
        else:
            self.clock.stop(now)

    def request_done(self) -> None:
        """The response went out: the next request must start within the idle deadline."""
        self.clock.stop(self._loop.time())
        self.clock.new_frame()
        self.clock.idle_timeout = self.limits.cfg.idle_timeout
        if not self._gone:
            self._wait(idle=True)

    # ---------------------------------------------------------------- deadlines
    def _wait(self, idle: bool) -> None:
        self.clock.wait(self._loop.time(), idle=idle)
        self._timer.arm()

    def _deadline_passed(self, reason: str) -> None:
        if self._gone:
            return
        peer = self.transport.get_extra_info("peername") or ("?", 0)
        log.info("closing HTTP connection from %s:%s: %s", peer[0], peer[1], self.clock.describe(reason))
        if reason == IDLE:
            self.transport.close()
        else:  # a client that stopped sending may not read either: do not wait to flush
            self.transport.abort()
