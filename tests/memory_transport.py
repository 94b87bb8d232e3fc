"""An in-memory asyncio transport for driving a protocol without sockets.

The test side feeds bytes (in any split) and reads what the protocol wrote. It honours
``pause_reading``/``resume_reading`` (bytes wait until reading resumes, as in a kernel
buffer) and calls ``pause_writing``/``resume_writing`` around a write high-water mark that
the test empties with :meth:`take_written`.
"""
from __future__ import annotations

import asyncio
from collections import deque


class MemoryTransport(asyncio.Transport):
    def __init__(self, protocol: asyncio.BaseProtocol, *, write_high: int = 1 << 20):
        super().__init__()
        self._protocol = protocol
        self._loop = asyncio.get_running_loop()
        self.written = bytearray()
        self.reading = True
        self.closed = False
        self.aborted = False
        self._pending: deque[bytes] = deque()
        self._eof_pending = False
        self._write_high = write_high
        self._write_low = write_high // 4
        self._write_paused = False
        self.max_recv = 1 << 16  # bytes handed over per buffer_updated call at most
        protocol.connection_made(self)

    # ---- the test side --------------------------------------------------------------------
    def feed(self, data: bytes, pieces: list[int] | None = None) -> None:
        """Queue ``data`` as received segments (``pieces``: their sizes, the rest in one)."""
        pos = 0
        for n in pieces or []:
            if pos < len(data):
                self._pending.append(data[pos:pos + n])
                pos += n
        if pos < len(data):
            self._pending.append(data[pos:])
        self._pump()

    def feed_eof(self) -> None:
        self._eof_pending = True
        self._pump()

    def take_written(self) -> bytes:
        out = bytes(self.written)
        self.written.clear()
        if self._write_paused and len(self.written) <= self._write_low:
            self._write_paused = False
            self._protocol.resume_writing()
        return out

    def _pump(self) -> None:
        while self.reading and not self.closed and self._pending:
            seg = self._pending.popleft()
            while seg and self.reading and not self.closed:
                room = self._protocol.get_buffer(-1)
                n = min(len(room), len(seg), self.max_recv)
                room[:n] = seg[:n]
                seg = seg[n:]
                self._protocol.buffer_updated(n)
            if seg:
                self._pending.appendleft(seg)
        if self.reading and not self.closed and not self._pending and self._eof_pending:
            self._eof_pending = False
            self._protocol.eof_received()

    # ---- asyncio.Transport ----------------------------------------------------------------
    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 40000)}.get(name, default)

    def write(self, data) -> None:
        if self.closed:  # as uvloop's TCPTransport (asyncio's would drop the data and log)
            raise RuntimeError(f"unable to perform operation on {self!r}; the handler is closed")
        self.written += data
        if not self._write_paused and len(self.written) > self._write_high:
            self._write_paused = True
            self._protocol.pause_writing()

    def get_write_buffer_size(self) -> int:
        return len(self.written)

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        self._write_high = (1 << 20) if high is None else high
        self._write_low = self._write_high // 4 if low is None else low
        if not self._write_paused and len(self.written) > self._write_high:
            self._write_paused = True
            self._protocol.pause_writing()

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._loop.call_soon(self._protocol.connection_lost, None)

    def abort(self) -> None:
        self.aborted = True
        self.close()

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        if not self.reading:
            self.reading = True
            self._loop.call_soon(self._pump)

    def is_reading(self) -> bool:
        return self.reading

    def set_protocol(self, protocol) -> None:
        self._protocol = protocol

    def get_protocol(self):
        return self._protocol
