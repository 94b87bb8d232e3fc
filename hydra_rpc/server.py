"""Accept loop and first-byte dispatch for the shared engine port.

    59 48 → Hydra connection loop (the bytes already read start the first header)
    0E    → ggml-RPC passthrough (when an upstream or the embedded server is configured)
    other → close without reply, one log line with a bounded hex preview

Shutdown sequence (``HydraServer.shutdown``), like uvicorn's:
 1. stop accepting (close the listening socket);
 2. close idle connections at once, let connections with a request in flight finish it,
    up to ``shutdown_timeout`` seconds;
 3. cancel whatever is still running and close those connections;
 4. the caller then stops the engine (``serve_cmd``).
A second SIGINT/SIGTERM skips step 2 (force exit).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from typing import Callable

from codec.enums import Status
from codec.framing import MAGIC_BYTES

from .config import ServerConfig
from .connection import Handler, HydraConnection
from .passthrough import GgmlPassthrough
from .wire import ResponseWriter

log = logging.getLogger("hydra_rpc.server")

GGML_HELLO = 0x0E


class _Protocol(asyncio.StreamReaderProtocol):
    """A stream protocol that also tells us at once when the peer goes away."""

    def __init__(self, reader, cb, loop):
        super().__init__(reader, cb, loop=loop)
        self.peer_gone = asyncio.Event()

    def eof_received(self):
        self.peer_gone.set()
        return super().eof_received()

    def connection_lost(self, exc):
        self.peer_gone.set()
        super().connection_lost(exc)


class HydraServer:
    def __init__(self, cfg: ServerConfig, handlers: dict[int, Handler],
                 on_request: Callable | None = None):
        self.cfg = cfg
        self.handlers = handlers
        self.on_request = on_request
        self._server: asyncio.base_events.Server | None = None
        self._ids = itertools.count(1)
        self.connections: dict[int, tuple[asyncio.Task, HydraConnection | None]] = {}
        self.passthrough = GgmlPassthrough(cfg)
        self.stats = {"accepted": 0, "refused_limit": 0, "refused_allow": 0, "closed_unknown": 0,
                      "hydra": 0, "ggml": 0}

    @property
    def sockets(self):
        return self._server.sockets if self._server else []

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sockets[0].getsockname()[:2]
        return host, port

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def factory():
            reader = asyncio.StreamReader(limit=2**20, loop=loop)
            return _Protocol(reader, self._on_connect, loop)

        self._server = await loop.create_server(factory, self.cfg.host, self.cfg.port, backlog=1024,
                                                reuse_address=True)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn_id = next(self._ids)
        task = asyncio.current_task()
        self.connections[conn_id] = (task, None)
        peer = writer.get_extra_info("peername") or ("?", 0)
        peer_s = f"{peer[0]}:{peer[1]}"
        self.stats["accepted"] += 1
        try:
            await self._handle(reader, writer, conn_id, peer, peer_s)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("connection %d failed", conn_id)
        finally:
            self.connections.pop(conn_id, None)
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            except (Exception, asyncio.CancelledError):
                pass

    async def _handle(self, reader, writer, conn_id, peer, peer_s) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if not self.cfg.peer_allowed(peer[0]):
            self.stats["refused_allow"] += 1
            log.warning("refused %s: not in --allow", peer_s)
            return
        try:
            async with asyncio.timeout(self.cfg.first_bytes_timeout):
                first = await reader.readexactly(1)
                if first[0] == MAGIC_BYTES[0]:
                    first += await reader.readexactly(1)
        except (TimeoutError, asyncio.IncompleteReadError) as e:
            if isinstance(e, TimeoutError):
                log.info("closed %s: sent nothing within %.0fs", peer_s, self.cfg.first_bytes_timeout)
            return
        over_limit = len(self.connections) > self.cfg.max_connections
        if first == MAGIC_BYTES:
            self.stats["hydra"] += 1
            if over_limit:
                self.stats["refused_limit"] += 1
                await ResponseWriter(writer).send(
                    Status.BUSY, {"error": f"connection limit of {self.cfg.max_connections} reached; retry later"})
                return
            proto = writer.transport.get_protocol()
            conn = HydraConnection(reader, writer, self.cfg, self.handlers, conn_id, peer_s,
                                   getattr(proto, "peer_gone", asyncio.Event()), self.on_request)
            self.connections[conn_id] = (asyncio.current_task(), conn)
            await conn.serve(first)
        elif first[0] == GGML_HELLO:
            self.stats["ggml"] += 1
            if over_limit:
                self.stats["refused_limit"] += 1
                log.warning("refused ggml-RPC client %s: connection limit", peer_s)
                return
            await self.passthrough.handle(reader, writer, first, peer_s)
        else:
            self.stats["closed_unknown"] += 1
            try:  # a little more context for the log line, without waiting long
                async with asyncio.timeout(0.05):
                    first += await reader.read(14)
            except TimeoutError:
                pass
            log.warning("closed %s: unknown protocol, first bytes %s", peer_s, first[:16].hex(" "))

    async def shutdown(self, timeout: float | None = None, force: bool = False) -> None:
        timeout = self.cfg.shutdown_timeout if timeout is None else timeout
        if self._server is not None:
            self._server.close()
        # Idle connections (no request in flight) close now.
        for task, conn in list(self.connections.values()):
            if force or conn is None or not conn.in_request:
                task.cancel()
            else:
                conn.stopping = True
        busy = [t for t, _ in self.connections.values() if not t.done()]
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
