"""ggml-RPC passthrough: a ggml client on the engine port, relayed to an rpc-server.

The upstream is either ``--ggml-rpc-upstream HOST:PORT`` (one connection per client: ggml-RPC
connection state is not transferable, and the server serves one client at a time) or, with
``--ggml-rpc-embedded``, a child process of its own per session (hydra_rpc/ggml/children.py),
so nothing a ggml client sends can take the Hydra or HTTP side down.

Every session opens with our own HELLO to the upstream; the client's HELLO is answered from it
(zero conn_caps: TCP both ways). From then on the session guard (codec/ggml/guard.py) checks
every frame before it is forwarded, and the relay (hydra_rpc/ggml/relay.py) moves the bytes on
two threads, outside the event loop. A refused frame closes the session: ggml-RPC has no
error frame.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket

from codec.errors import CodecError
from codec.ggml.guard import SessionGuard
from engine.ggml_rpc_lib import open_session

from hydra_rpc.config import ServerConfig
from hydra_rpc.ggml.children import GgmlChild, GgmlChildPool
from hydra_rpc.ggml.relay import Relay
from hydra_rpc.observability.logs import Throttle

log = logging.getLogger("hydra_rpc.passthrough")
UNBOUNDED = 1 << 64


def _memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _take_socket(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[socket.socket, bytes]:
    """Take the client's connection out of the event loop: a blocking socket of its own (a dup,
    so closing the transport leaves the connection up) and the bytes already buffered."""
    transport = writer.transport
    transport.pause_reading()
    sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
    sock.setblocking(True)
    buffered = bytes(reader._buffer)  # noqa: SLF001 - the stream layer is being left behind
    reader._buffer.clear()  # noqa: SLF001
    transport.close()
    return sock, buffered


class GgmlPassthrough:
    """The entry point the dispatcher calls: ``await handle(reader, writer, first, peer)``."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.upstream: tuple[str, int] | None = cfg.ggml_rpc_upstream
        self.pool: GgmlChildPool | None = None
        self.sessions = 0
        self._closed_up = self._closed_down = 0
        self._live: set[Relay] = set()
        # a client retrying in a loop repeats these at will: each is logged once a minute at most
        self._busy_warning, self._upstream_warning, self._off_warning = Throttle(), Throttle(), Throttle()

    @property
    def bytes_up(self) -> int:
        return self._closed_up + sum(r.up for r in self._live)

    @property
    def bytes_down(self) -> int:
        return self._closed_down + sum(r.down for r in self._live)

    async def start_embedded(self) -> None:
        """Start the child pool: one child ready now, one spare kept ahead of every session."""
        self.pool = GgmlChildPool(self.cfg.ggml_rpc_embedded_threads, self.cfg.ggml_rpc_sessions)
        await self.pool.start()
        log.info("embedded ggml-RPC server: a child process per session, up to %d at once",
                 self.cfg.ggml_rpc_sessions)

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bytes,
                     peer: str) -> None:
        child: GgmlChild | None = None
        if self.pool is not None:
            child = await self.pool.acquire(self.cfg.ggml_connect_timeout)
            if child is None:
                self._busy_warning.warn(log, "closed ggml-RPC client %s: all %d embedded ggml sessions busy", peer,
                                        self.cfg.ggml_rpc_sessions)
                return
            upstream, version, budget = child.sock, child.hello.version, _memory_bytes()
        elif self.upstream is not None:
            try:
                upstream, reply = await asyncio.to_thread(open_session, *self.upstream, self.cfg.ggml_connect_timeout)
            except (OSError, CodecError) as e:
                self._upstream_warning.warn(
                    log, "closed ggml-RPC client %s: upstream %s:%d unusable (busy, down or not ggml-RPC): %s",
                    peer, *self.upstream, e)
                return
            version, budget = reply.version, UNBOUNDED  # the upstream's memory is its own business
        else:
            self._off_warning.warn(
                log, "closed ggml-RPC client %s: passthrough is off (no --ggml-rpc-upstream/--ggml-rpc-embedded)", peer)
            return
        client, buffered = _take_socket(reader, writer)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        relay = Relay(client, upstream, SessionGuard(version, max_alloc_bytes=budget), peer, first + buffered,
                      lambda: loop.call_soon_threadsafe(_settle, done))
        self.sessions += 1
        self._live.add(relay)
        log.info("ggml-RPC %s ↔ %s (protocol %s)", peer, f"child {child.pid}" if child else
                 "upstream %s:%d" % self.upstream, ".".join(map(str, version)))
        relay.start()
        try:
            await asyncio.shield(done)
        finally:
            relay.stop()
            await asyncio.shield(done)  # the threads are out of their sockets before these close
            self._live.discard(relay)
            self._closed_up += relay.up
            self._closed_down += relay.down
            client.close()
            if child is not None:
                self.pool.release(child)
            else:
                upstream.close()


def _settle(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
