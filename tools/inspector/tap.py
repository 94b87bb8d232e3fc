"""``--listen HOST:PORT --upstream HOST:PORT``: a transparent, decoding TCP proxy.

Every accepted client gets its own upstream connection; both directions are copied unchanged,
chunk by chunk, with ``drain()`` after each write — a slow reader slows the writer down instead
of filling our memory (back-pressure). Each chunk is also fed to the :class:`Session`, whose
messages are printed as they complete, and, with ``--write``, appended to a pcap as TCP
segments of the client ↔ upstream conversation, which file mode reads back.

A half-close is forwarded as a half-close (``write_eof``): PIN DECODE streams end with the
server closing, and ggml clients rely on ordered shutdown.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from typing import Callable

from .pcap_io import PcapWriter
from .session import Session

log = logging.getLogger("hydra_rpc.inspect.tap")
CHUNK = 256 * 1024


class Tap:
    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], session: Session,
                 writer: PcapWriter | None = None, on_event: Callable[[str], None] | None = None,
                 connect_timeout: float = 10.0):
        self.listen, self.upstream = listen, upstream
        self.session, self.pcap = session, writer
        self.on_event = on_event or (lambda s: None)
        self.connect_timeout = connect_timeout
        self._ids = itertools.count()
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()
        self.bytes = {"c2s": 0, "s2c": 0}

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[:2]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._client, *self.listen, limit=CHUNK)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.cancel()
        if self._conns:
            await asyncio.wait(self._conns, timeout=5.0)
        self.session.finish()

    async def _client(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        sid = next(self._ids)
        peer = c_writer.get_extra_info("peername") or ("?", 0)
        client = (str(peer[0]), int(peer[1]))
        u_writer = None
        try:
            try:
                async with asyncio.timeout(self.connect_timeout):
                    u_reader, u_writer = await asyncio.open_connection(*self.upstream, limit=CHUNK)
            except (OSError, TimeoutError) as e:
                self.on_event(f"stream {sid}: upstream {self.upstream[0]}:{self.upstream[1]} unreachable: {e}")
                return
            for w in (c_writer, u_writer):
                sock = w.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            now = time.time()
            self.session.open(sid, client, self.upstream)
            if self.pcap is not None:
                self.pcap.open(sid, client, self.upstream, now)
            up = asyncio.create_task(self._pump(sid, "c2s", c_reader, u_writer))
            down = asyncio.create_task(self._pump(sid, "s2c", u_reader, c_writer))
            try:
                await asyncio.gather(up, down)
            finally:
                up.cancel()
                down.cancel()
                await asyncio.gather(up, down, return_exceptions=True)
        except asyncio.CancelledError:
            pass
        finally:
            for w in (c_writer, u_writer):
                if w is not None:
                    w.close()
            for d in ("c2s", "s2c"):
                if sid in self.session.streams and d not in self.session.streams[sid].ended:
                    self._end(sid, d)
            self._conns.discard(task)

    def _end(self, sid: int, direction: str) -> None:
        now = time.time()
        self.session.end(sid, direction, now)
        if self.pcap is not None:
            self.pcap.fin(sid, direction, now)

    async def _pump(self, sid: int, direction: str, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await src.read(CHUNK)
                if not data:
                    break
                dst.write(data)  # forward first: decoding never delays the peer
                now = time.time()
                self.bytes[direction] += len(data)
                if self.pcap is not None:
                    self.pcap.data(sid, direction, data, now)
                self.session.data(sid, direction, data, now)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._end(sid, direction)
            try:
                if dst.can_write_eof() and not dst.is_closing():
                    dst.write_eof()
            except (OSError, RuntimeError):
                pass
