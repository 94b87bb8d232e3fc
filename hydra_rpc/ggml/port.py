"""llama-engine's ``--ggml-rpc-port``: ggml-RPC on a port of its own.

The C++ engine runs llama.cpp's rpc-server there, unguarded. Here the port is one more door to
the same guarded passthrough as the shared port: each session gets an embedded rpc-server child
of its own from the pool (docs/ggml.md), every command is checked by the session guard before it
is forwarded, and a malformed request can at most end that child — never the Hydra or HTTP ports.
"""
from __future__ import annotations

import asyncio
import logging

from codec.ggml import Cmd

from hydra_rpc.ggml.passthrough import GgmlPassthrough
from hydra_rpc.observability.logs import Throttle

log = logging.getLogger("hydra_rpc.ggml_rpc_port")


class GgmlRpcPort:
    def __init__(self, server: asyncio.Server, passthrough: GgmlPassthrough, first_bytes_timeout: float):
        self._server, self._passthrough, self._timeout = server, passthrough, first_bytes_timeout
        self.host, self.port = server.sockets[0].getsockname()[:2]
        self._sessions: set[asyncio.Task] = set()
        self._not_hello_warning = Throttle()  # a scanner repeats it at will: once a minute

    @classmethod
    async def start(cls, passthrough: GgmlPassthrough, host: str, port: int,
                    first_bytes_timeout: float = 10.0) -> "GgmlRpcPort":
        """Listen; OSError when the port cannot be bound. The passthrough's embedded pool must run."""
        holder: list[GgmlRpcPort] = []
        server = await asyncio.start_server(lambda r, w: holder[0]._session(r, w), host, port)
        holder.append(cls(server, passthrough, first_bytes_timeout))
        log.info("ggml-RPC port on %s:%d (guarded, an embedded rpc-server child per session)",
                 holder[0].host, holder[0].port)
        return holder[0]

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "%s:%s" % (writer.get_extra_info("peername") or ("?", 0))[:2]
        self._sessions.add(asyncio.current_task())
        try:
            try:
                async with asyncio.timeout(self._timeout):
                    first = await reader.readexactly(1)
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                return
            if first[0] != Cmd.HELLO:
                self._not_hello_warning.warn(log, "closed %s on the ggml-RPC port: first byte %02x is not HELLO", peer,
                                             first[0])
                return
            await self._passthrough.handle(reader, writer, first, peer)
        finally:
            self._sessions.discard(asyncio.current_task())
            writer.close()

    async def stop(self) -> None:
        self._server.close()
        for t in list(self._sessions):
            t.cancel()
        await asyncio.gather(*self._sessions, return_exceptions=True)
        await self._server.wait_closed()
