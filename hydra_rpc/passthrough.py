"""ggml-RPC passthrough: splice a ggml client to an upstream rpc-server.

Each client gets its own upstream connection (ggml-RPC connection state is not
transferable, and the upstream serves one client at a time). The bytes the
dispatcher already read are replayed first; then both directions are spliced by two
small protocols that hand every received chunk straight to the other side's transport
— no coroutine hop per chunk, which matters for ggml's many tiny round trips — with
back-pressure: when one side's write buffer fills, the other side stops reading.
TCP_NODELAY on both legs. A half-close is forwarded (replies still owed keep flowing);
a full close or reset of either side closes the other.
"""
from __future__ import annotations

import asyncio
import logging
import socket

from .config import ServerConfig

log = logging.getLogger("hydra_rpc.passthrough")
HIGH_WATER = 4 << 20  # bytes queued towards one side before the other side is paused


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Leg(asyncio.Protocol):
    """One direction's receiver: forwards to ``peer`` and mirrors flow control."""

    def __init__(self, name: str, counter: list[int], done: asyncio.Future):
        self.name = name
        self.counter = counter  # [bytes] shared with the passthrough stats
        self.done = done
        self.transport: asyncio.Transport | None = None
        self.peer: "_Leg | None" = None
        self.eof = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        self.counter[0] += len(data)
        peer = self.peer.transport
        if not peer.is_closing():
            peer.write(data)

    def eof_received(self) -> bool:
        self.eof = True
        peer = self.peer.transport
        if peer is not None and not peer.is_closing() and peer.can_write_eof():
            peer.write_eof()  # forward the half-close; keep the other direction open
        if self.peer.eof:
            self._finish()
        return True

    def connection_lost(self, exc) -> None:
        self._finish()

    def _finish(self) -> None:
        for leg in (self, self.peer):
            if leg.transport is not None and not leg.transport.is_closing():
                leg.transport.close()
        if not self.done.done():
            self.done.set_result(None)

    # The *other* side's buffer filled/drained: stop/resume reading here.
    def pause_writing(self) -> None:
        self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        self.peer.transport.resume_reading()


class GgmlPassthrough:
    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.upstream: tuple[str, int] | None = cfg.ggml_rpc_upstream
        self._up = [0]
        self._down = [0]
        self.sessions = 0

    @property
    def bytes_up(self) -> int:
        return self._up[0]

    @property
    def bytes_down(self) -> int:
        return self._down[0]

    @property
    def enabled(self) -> bool:
        return self.upstream is not None

    def start_embedded(self) -> tuple[str, int]:
        """Start llama.cpp's own ggml RPC server in this process on a private loopback port."""
        from engine.ggml_rpc_lib import start_embedded_rpc_server

        self.upstream = start_embedded_rpc_server("127.0.0.1", 0, self.cfg.ggml_rpc_embedded_threads)
        log.info("embedded ggml-RPC server on %s:%d", *self.upstream)
        return self.upstream

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bytes,
                     peer: str) -> None:
        if self.upstream is None:
            log.warning("closed ggml-RPC client %s: passthrough is off (no --ggml-rpc-upstream)", peer)
            return
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        client_leg = _Leg("up", self._up, done)  # receives from the client
        upstream_leg = _Leg("down", self._down, done)  # receives from the upstream
        client_leg.peer, upstream_leg.peer = upstream_leg, client_leg
        try:
            async with asyncio.timeout(self.cfg.ggml_connect_timeout):
                up_transport, _ = await loop.create_connection(lambda: upstream_leg, *self.upstream)
        except (OSError, TimeoutError) as e:
            log.warning("closed ggml-RPC client %s: upstream %s:%d unreachable: %s", peer, *self.upstream, e)
            return
        _nodelay(up_transport)
        self.sessions += 1
        log.info("ggml-RPC %s ↔ upstream %s:%d", peer, *self.upstream)
        # Bytes the dispatcher (and the stream reader) already took off the client socket.
        buffered = bytes(reader._buffer)  # noqa: SLF001 - the stream layer is being left behind
        reader._buffer.clear()  # noqa: SLF001
        up_transport.write(first + buffered)
        self._up[0] += len(first) + len(buffered)
        transport = writer.transport
        client_leg.connection_made(transport)
        transport.set_protocol(client_leg)
        transport.resume_reading()
        if reader.at_eof():  # the client already half-closed before the switch
            client_leg.eof_received()
        try:
            await done
        finally:
            up_transport.close()
            transport.close()

    async def close(self) -> None:
        pass
