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

from codec import ggml as G
from codec.errors import CodecError

from .config import ServerConfig

log = logging.getLogger("hydra_rpc.passthrough")
HIGH_WATER = 4 << 20  # bytes queued towards one side before the other side is paused
CLIENT_VERSION = (7, 0, 0)  # the protocol of the llama.cpp the passthrough is tested with


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


GRAPH_BUFFER_CAP = 256 << 20  # a GRAPH_COMPUTE is node ids + tensor headers: megabytes, not more
_HDR = G.REQUEST_HEADER_STRUCT


def graph_problem(payload: bytes | bytearray | memoryview) -> str | None:
    """Why a GRAPH_COMPUTE must not reach the server.

    llama.cpp's rpc-server in llama-cpp-python 0.3.36 segfaults on a node id that names no
    tensor (found by ``hydra-rpc fuzz --protocol ggml``: node id 0). With
    ``--ggml-rpc-embedded`` that server lives in our process, so the passthrough checks
    every graph's node ids against its tensor ids before forwarding it.
    """
    try:
        graph = G.parse_graph_compute(payload, CLIENT_VERSION, allow_trailing=True)
    except CodecError as e:
        return f"GRAPH_COMPUTE: {e}"
    if 0 in graph.nodes:
        return "GRAPH_COMPUTE with a null node id"
    if not {t.id for t in graph.tensors}.issuperset(graph.nodes):
        return "GRAPH_COMPUTE node id names no tensor of the graph"
    return None


class _GuardedLeg(_Leg):
    """The client→upstream direction, followed frame by frame (``[cmd u8][size u64][payload]``).

    Frames stream through untouched, except GRAPH_COMPUTE, which is held until complete and
    checked by :func:`graph_problem`; a bad one closes the session instead of reaching (and
    crashing) the server. ggml-RPC has no error frame, so a close is the only answer.
    """

    def __init__(self, name, counter, done, peer_desc: str):
        super().__init__(name, counter, done)
        self.peer_desc = peer_desc
        self._hdr = b""
        self._left = 0  # payload bytes of the current frame still to pass
        self._graph: bytearray | None = None

    def data_received(self, data: bytes) -> None:
        self.counter[0] += len(data)
        out = []
        pos, n = 0, len(data)
        while pos < n:
            if self._left == 0 and self._graph is None:
                take = min(9 - len(self._hdr), n - pos)
                self._hdr += data[pos:pos + take]
                pos += take
                if len(self._hdr) < 9:
                    break
                cmd, size = _HDR.unpack(self._hdr)
                if cmd == G.Cmd.GRAPH_COMPUTE:
                    if size > GRAPH_BUFFER_CAP:
                        return self._refuse(f"GRAPH_COMPUTE of {size} bytes")
                    self._graph = bytearray(self._hdr)
                    self._left = size
                else:
                    out.append(self._hdr)
                    self._left = size
                self._hdr = b""
                if self._left == 0 and self._graph is not None:
                    if not self._graph_ok(out):
                        return None
                continue
            take = min(self._left, n - pos)
            chunk = data[pos:pos + take] if (pos or take != n) else data
            pos += take
            self._left -= take
            if self._graph is None:
                out.append(chunk)
                continue
            self._graph += chunk
            if self._left == 0 and not self._graph_ok(out):
                return None
        if out:
            peer = self.peer.transport
            if not peer.is_closing():
                peer.write(b"".join(out))

    def _graph_ok(self, out: list) -> bool:
        """The held GRAPH_COMPUTE is complete: queue it for forwarding, or refuse the session."""
        graph, self._graph = self._graph, None
        problem = graph_problem(memoryview(graph)[9:])
        if problem:
            self._refuse(problem)
            return False
        out.append(graph)  # handed over whole; never touched again
        return True

    def _refuse(self, why: str) -> None:
        log.warning("closed ggml-RPC client %s: %s (not forwarded)", self.peer_desc, why)
        self._finish()


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
        client_leg = _GuardedLeg("up", self._up, done, peer)  # receives from the client
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
        transport = writer.transport
        client_leg.peer.transport = up_transport
        client_leg.data_received(first + buffered)
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
