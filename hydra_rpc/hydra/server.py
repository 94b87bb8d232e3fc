"""Accept loop and first-byte dispatch for the shared engine port.

    59 48 → Hydra connection loop (the bytes already read start the first header)
    0E    → ggml-RPC passthrough (when an upstream or the embedded server is configured)
    other → close without reply, one log line with a bounded hex preview

Shutdown sequence (``HydraServer.shutdown``), like uvicorn's:
 1. stop accepting (close the listening socket);
 2. close idle connections at once, let connections with a request in flight finish it,
    up to ``shutdown_timeout`` seconds;
 3. cancel whatever is still running and close those connections;
 4. the caller then stops the engine (``cli.serve``).
A second SIGINT/SIGTERM skips step 2 (force exit).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from typing import Awaitable, Callable

from codec.enums import Status
from codec.framing import MAGIC_BYTES

from hydra_rpc.config import ServerConfig
from hydra_rpc.conn_budget import Acceptor, ConnectionBudget
from hydra_rpc.hydra.connection import Handler, HydraConnection
from hydra_rpc.observability.logs import Throttle, routine_level
from hydra_rpc.ggml.passthrough import GgmlPassthrough

log = logging.getLogger("hydra_rpc.server")

GGML_HELLO = 0x0E


class _Accepted(asyncio.BufferedProtocol):
    """A new connection until its first bytes say which protocol it speaks; then the transport
    goes to a :class:`HydraConnection` (or, for ggml-RPC, to a stream for the passthrough)
    together with the bytes received so far."""

    def __init__(self, server: "HydraServer"):
        self.server = server
        self.conn_id = next(server._ids)
        self.task: asyncio.Task | None = None  # the task serving the dispatched connection
        self.conn: HydraConnection | None = None
        self.transport: asyncio.Transport | None = None
        self.peer = "?:0"
        self._head = bytearray(64)
        self._n = 0
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        srv = self.server
        self.transport = transport
        srv.connections[self.conn_id] = self
        srv.stats["accepted"] += 1
        peer = transport.get_extra_info("peername") or ("?", 0)
        self.peer = f"{peer[0]}:{peer[1]}"
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if not srv.cfg.peer_allowed(peer[0]):
            srv.stats["refused_allow"] += 1
            srv.warn("refused_allow", "refused %s: not in --allow", self.peer)
            transport.close()
            return
        self._timer = asyncio.get_running_loop().call_later(srv.cfg.first_bytes_timeout, self._silent)

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._head)[self._n:]

    def buffer_updated(self, nbytes: int) -> None:
        self._n += nbytes
        head = bytes(self._head[:self._n])
        if head[0] == MAGIC_BYTES[0] and len(head) < 2:
            return  # one more byte decides between Hydra and garbage
        self._timer.cancel()
        self.server._dispatch(self, head)

    def eof_received(self) -> bool:
        self.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.task is None:
            self.server.forget(self.conn_id)

    def _silent(self) -> None:
        # routine: a TCP health check connects and closes without a byte
        log.log(routine_level(), "closed %s: sent nothing within %.0fs", self.peer, self.server.cfg.first_bytes_timeout)
        self.transport.close()

    def close(self) -> None:
        """Shutdown: stop whatever this connection is doing now."""
        if self.task is not None:
            self.task.cancel()
        else:
            self.transport.close()


class HydraServer:
    def __init__(self, cfg: ServerConfig, handlers: dict[int, Handler], on_request: Callable | None = None,
                 budget: ConnectionBudget | None = None):
        self.cfg = cfg
        self.handlers = handlers
        self.on_request = on_request
        # shared with the HTTP side when there is one (App); else this port's own
        self.budget = budget or ConnectionBudget(cfg.max_connections, cfg.max_connections + 64)
        self._server: Acceptor | None = None
        self._ids = itertools.count(1)
        self.connections: dict[int, _Accepted] = {}
        self.passthrough = GgmlPassthrough(cfg)
        self.stats = {"accepted": 0, "refused_limit": 0, "refused_allow": 0, "closed_unknown": 0,
                      "hydra": 0, "ggml": 0}
        self._warnings = {kind: Throttle() for kind in ("refused_allow", "refused_limit", "closed_unknown")}

    @property
    def sockets(self):
        return self._server.sockets if self._server else []

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sockets[0].getsockname()[:2]
        return host, port

    async def start(self) -> None:
        self._server = Acceptor.listen(self.cfg.host, self.cfg.port, lambda: _Accepted(self), self.budget)

    def warn(self, kind: str, msg: str, *args: object) -> None:
        """A refusal or a close that any client can repeat: logged once a minute at most for
        each ``kind`` (the ``stats`` count every one)."""
        self._warnings[kind].warn(log, msg, *args)

    def forget(self, conn_id: int) -> None:
        """A connection is gone: its place in the budget frees (once)."""
        if self.connections.pop(conn_id, None) is not None:
            self.budget.closed()

    def _dispatch(self, acc: _Accepted, head: bytes) -> None:
        transport = acc.transport
        over_limit = self.budget.over_limit
        if head[:2] == MAGIC_BYTES:
            self.stats["hydra"] += 1
            conn = HydraConnection(self.cfg, self.handlers, acc.conn_id, acc.peer, self.on_request)
            transport.set_protocol(conn)
            conn.connection_made(transport)
            if over_limit:
                self.stats["refused_limit"] += 1
                acc.task = asyncio.ensure_future(conn.refuse_connection(
                    Status.BUSY, {"error": f"connection limit of {self.budget.max_connections} reached; retry later"}))
            else:
                conn.decoder.feed(head)
                acc.conn = conn
                acc.task = asyncio.ensure_future(conn.serve())
        elif head[0] == GGML_HELLO:
            self.stats["ggml"] += 1
            if over_limit:
                self.stats["refused_limit"] += 1
                self.warn("refused_limit", "refused ggml-RPC client %s: connection limit", acc.peer)
                transport.close()
                return
            acc.task = asyncio.ensure_future(self._passthrough(transport, head, acc.peer))
        else:
            self.stats["closed_unknown"] += 1
            self.warn("closed_unknown", "closed %s: unknown protocol, first bytes %s", acc.peer, head[:16].hex(" "))
            transport.close()
            return
        acc.task.add_done_callback(lambda t: self._finished(acc, t))

    def _passthrough(self, transport: asyncio.Transport, head: bytes, peer: str) -> Awaitable[None]:
        """Hand the connection to the ggml-RPC passthrough as a stream. The protocol is switched
        *now*, not when the coroutine first runs: bytes (or an EOF) that arrive in between must
        land in the stream, not in the dispatcher's small head buffer."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=2**20, loop=loop)
        proto = asyncio.StreamReaderProtocol(reader, loop=loop)
        transport.set_protocol(proto)
        proto.connection_made(transport)
        reader.feed_data(head[1:])
        writer = asyncio.StreamWriter(transport, proto, reader, loop)
        return self.passthrough.handle(reader, writer, head[:1], peer)

    def _finished(self, acc: _Accepted, task: asyncio.Task) -> None:
        self.forget(acc.conn_id)
        if not task.cancelled() and task.exception() is not None and not isinstance(
                task.exception(), (ConnectionError, TimeoutError)):
            log.error("connection %d failed", acc.conn_id, exc_info=task.exception())
        acc.transport.close()

    async def shutdown(self, timeout: float | None = None, force: bool = False) -> None:
        timeout = self.cfg.shutdown_timeout if timeout is None else timeout
        if self._server is not None:
            self._server.close()
        # Idle connections (no request in flight) close now.
        for acc in list(self.connections.values()):
            if force or acc.conn is None or not acc.conn.in_request:
                acc.close()
            else:
                acc.conn.stopping = True
        busy = [acc.task for acc in self.connections.values() if acc.task is not None and not acc.task.done()]
        if busy and not force:
            done, pending = await asyncio.wait(busy, timeout=timeout)
            for t in pending:
                t.cancel()
            busy = list(pending)
        if busy:
            await asyncio.wait(busy, timeout=2.0)
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            except (TimeoutError, asyncio.TimeoutError):
                pass
