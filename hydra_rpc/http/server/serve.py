"""The HTTP side's listening socket and its connections (one :class:`HttpConnection` each).

Accepting is the engine port's: ``conn_budget.Acceptor`` counts every connection against the
shared budget and, at its ceiling, leaves clients in the kernel's backlog. Closing is
graceful: the socket stops accepting, idle connections close at once, and requests in flight
get ``shutdown_timeout`` seconds to finish before their connections are cut.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from hydra_rpc.config import ServerConfig
from hydra_rpc.conn_budget import Acceptor, ConnectionBudget
from hydra_rpc.http.server.connection import HttpConnection
from hydra_rpc.http.server.messages import Request, Response, StreamResponse
from hydra_rpc.observability.logs import Throttle, log_http_access

Respond = Callable[[Request], Awaitable["Response | StreamResponse"]]


class HttpServer:
    def __init__(self, respond: Respond, cfg: ServerConfig, budget: ConnectionBudget,
                 access_log: Callable[[Request, int, int, float], None] = log_http_access):
        self.respond, self.cfg, self.budget, self.access_log = respond, cfg, budget, access_log
        # kept-alive connections wait for their next request at most the shorter of the two
        self.idle_timeout = min(cfg.idle_timeout, cfg.http_timeout)
        self.connections: set[HttpConnection] = set()
        self.closing = False
        self.bad_requests = Throttle()  # a scanner sends what is not HTTP at will: a line a minute
        self._acceptor: Acceptor | None = None
        self._all_closed: asyncio.Event | None = None  # set by the last connection to go, while closing

    def listen(self, host: str, port: int, backlog: int = 1024) -> None:
        """Bind (port 0 picks a free port) and accept on the running loop."""
        self._acceptor = Acceptor.listen(host, port, self._connection, self.budget, backlog)

    def _connection(self) -> HttpConnection:
        return HttpConnection(self)

    def connection_gone(self, conn: HttpConnection) -> None:
        self.connections.discard(conn)
        if not self.connections and self._all_closed is not None:
            self._all_closed.set()

    @property
    def address(self) -> tuple[str, int]:
        assert self._acceptor is not None, "not listening"
        host, port = self._acceptor.sock.getsockname()[:2]
        return host, port

    async def close(self, timeout: float | None = None) -> None:
        """Stop accepting; let answers in progress finish for ``timeout`` seconds (the
        configured ``shutdown_timeout`` by default), then cut what is left."""
        self.closing = True
        if self._acceptor is not None:
            self._acceptor.close()
            await self._acceptor.wait_closed()
        self._all_closed = asyncio.Event()
        for conn in list(self.connections):
            conn.close_idle()  # a busy one closes after its answer, which says Connection: close
        if self.connections:
            try:
                await asyncio.wait_for(self._all_closed.wait(),
                                       self.cfg.shutdown_timeout if timeout is None else timeout)
            except asyncio.TimeoutError:
                for conn in list(self.connections):
                    conn.abort()
                await asyncio.sleep(0)  # the aborts' connection_lost calls
