"""ggml-RPC passthrough: splice a ggml client to an upstream rpc-server.

Each client gets its own upstream connection (ggml-RPC connection state is not
transferable, and the upstream serves one client at a time). The bytes the
dispatcher already read are replayed first; then both directions are copied with
back-pressure (``drain`` after every write) and TCP_NODELAY on both legs. Either side
closing closes the other — a ggml client aborts on a lost upstream anyway.
"""
from __future__ import annotations

import asyncio
import logging
import socket

from .config import ServerConfig

log = logging.getLogger("hydra_rpc.passthrough")
CHUNK = 1 << 20


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class GgmlPassthrough:
    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.upstream: tuple[str, int] | None = cfg.ggml_rpc_upstream
        self.bytes_up = 0
        self.bytes_down = 0
        self.sessions = 0

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
        try:
            async with asyncio.timeout(self.cfg.ggml_connect_timeout):
                up_r, up_w = await asyncio.open_connection(*self.upstream, limit=CHUNK)
        except (OSError, TimeoutError) as e:
            log.warning("closed ggml-RPC client %s: upstream %s:%d unreachable: %s", peer, *self.upstream, e)
            return
        _nodelay(up_w)
        self.sessions += 1
        log.info("ggml-RPC %s ↔ upstream %s:%d", peer, *self.upstream)
        up_w.write(first)
        self.bytes_up += len(first)
        t1 = asyncio.create_task(self._pump(reader, up_w, "up"))
        t2 = asyncio.create_task(self._pump(up_r, writer, "down"))
        try:
            done, _ = await asyncio.wait({t1, t2}, return_when=asyncio.FIRST_COMPLETED)
            if t2 not in done:
                # The client half-closed (or vanished): its EOF went upstream; replies still owed
                # keep flowing until the upstream closes too.
                await t2
        finally:
            for t in (t1, t2):
                t.cancel()
            await asyncio.gather(t1, t2, return_exceptions=True)
            up_w.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: str) -> None:
        try:
            while True:
                data = await src.read(CHUNK)
                if not data:
                    break
                dst.write(data)
                if direction == "up":
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            try:
                if dst.can_write_eof():
                    dst.write_eof()
            except (OSError, RuntimeError):
                pass

    async def close(self) -> None:
        pass
