"""Reading what a Hydra target sends back, under deadlines, without trusting its lengths.

An ``Inbox`` pumps one connection's bytes in a background task from the moment it opens,
so a server that answers early (a refusal) while we are still sending is never blocked,
and nothing it sends is lost to a later RST. ``read_response`` parses one response from it
with the codec's ``ResponseDecoder``, taking no byte past that response:

* header, meta (kept), payload (kept up to a cap, else dropped chunk by chunk as it arrives —
  a lying payload_len never makes us allocate it);
* PIN dialect: when ``codec.dialects.pin_stream_follows`` says so for the request's dialect,
  ``[u32 len][piece]`` frames follow until the server closes — legal, not a desync;
* deadlines are *idle* deadlines (no byte for ``idle`` seconds → ``Stalled``) plus an overall
  cap for streams (``until``).
"""
from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass
from typing import Any

from codec.decoder import NEED_DATA, PayloadChunk, ResponseDecoder, ResponseStart
from codec.dialects import Dialect, pin_stream_follows
from codec.enums import status_name
from codec.errors import CodecError
from codec.payloads import PieceStreamDecoder, decode_meta

KEEP_PAYLOAD = 64 << 20  # payload bytes kept per response (STATE_GET blobs for the stateful model)
KEEP_RAW = 4096  # raw received bytes kept for a case report
CSHARP_MAX_PAYLOAD = 4 << 30  # C# ValidatePayloadLen: more is a broken stream to every real client


class Closed(Exception):
    """EOF (or reset). ``partial`` = bytes of an unfinished structure seen before it."""

    def __init__(self, partial: int = 0, what: str = ""):
        super().__init__(f"closed after {partial} bytes of {what}" if partial else "closed")
        self.partial = partial


class Stalled(Exception):
    """Nothing arrived within the idle deadline (or the overall cap passed)."""


class Malformed(Exception):
    """The response stream broke the framing."""


class Inbox:
    def __init__(self, reader: asyncio.StreamReader, keep_raw: int = KEEP_RAW):
        self.buf = bytearray()
        self.raw = bytearray()
        self.keep_raw = keep_raw
        self.total = 0
        self.eof = False
        self.reset = False
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._pump(reader))

    async def _pump(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                self.buf += data
                self.total += len(data)
                if len(self.raw) < self.keep_raw:
                    self.raw += data[: self.keep_raw - len(self.raw)]
                self._wake.set()
        except (ConnectionError, OSError):
            self.reset = True
        finally:
            self.eof = True
            self._wake.set()

    async def _wait(self, idle: float, until: float | None) -> None:
        loop = asyncio.get_running_loop()
        timeout = idle if until is None else min(idle, until - loop.time())
        if timeout <= 0:
            raise Stalled("overall deadline passed")
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise Stalled(f"nothing for {timeout:.1f}s") from None

    async def take(self, n: int, idle: float, until: float | None = None, what: str = "") -> bytes:
        while len(self.buf) < n:
            if self.eof:
                raise Closed(len(self.buf), what)
            await self._wait(idle, until)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def take_some(self, n: int, idle: float, until: float | None = None) -> bytes:
        """Between 1 and ``n`` bytes, as soon as any are there; b"" at EOF."""
        while not self.buf:
            if self.eof:
                return b""
            await self._wait(idle, until)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def settle(self, grace: float) -> str:
        """After the expected replies: "data" (unsolicited bytes), "eof", or "quiet"."""
        if self.buf:
            return "data"
        if self.eof:
            return "eof"
        await asyncio.sleep(0)  # let the pump see whatever is already in the socket
        if grace > 0 and not self.buf and not self.eof:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), grace)
            except (TimeoutError, asyncio.TimeoutError):
                pass
        return "data" if self.buf else "eof" if self.eof else "quiet"

    async def wait_eof(self, idle: float) -> str:
        """"eof", "data" (something arrived instead) or "timeout"."""
        try:
            while not self.eof:
                if self.buf:
                    return "data"
                await self._wait(idle, None)
        except Stalled:
            return "timeout"
        return "data" if self.buf else "eof"

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.wait([self._task])  # never swallows a cancellation of *our* task (SIGINT)


@dataclass
class Resp:
    status: int
    meta_raw: bytes
    meta: dict[str, Any] | None
    payload_len: int
    payload: bytes | None  # None when it was larger than the keep cap
    meta_error: str = ""  # why the meta is not a JSON object (strict: no NaN/Infinity)
    pieces: int | None = None  # PIN stream: frames read before the close
    stream_unfinished: bool = False  # PIN stream still running when we gave up (slow, not broken)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": status_name(self.status), "meta_len": len(self.meta_raw),
                               "payload_len": self.payload_len}
        out["meta"] = self.meta if self.meta is not None else self.meta_raw[:300].decode("utf-8", "replace")
        if self.payload:
            out["payload_head_hex"] = self.payload[:32].hex()
        if self.pieces is not None:
            out["pin_pieces"] = self.pieces
        if self.stream_unfinished:
            out["stream_unfinished"] = True
        return out


async def read_response(inbox: Inbox, idle: float, *, dialect: Dialect | None = None,
                        until: float | None = None, keep: int = KEEP_PAYLOAD) -> Resp:
    """One response (``dialect``: the request's, which says whether a PIN stream may follow).
    Raises Closed (a clean close instead of a reply), Stalled, or Malformed."""
    dec = ResponseDecoder()
    start: ResponseStart | None = None
    payload: bytearray | None = None
    while True:
        ev = dec.next_event()
        if ev is NEED_DATA:
            try:
                data = await inbox.take_some(dec.wanted, idle)
            except Stalled as e:
                e.mid = not dec.at_boundary  # the header is consumed: this reply cannot be read again
                raise
            if not data:
                raise _closed_inside(dec, start)
            dec.feed(data)
        elif isinstance(ev, ResponseStart):
            start, h = ev, ev.header
            if h.payload_len > CSHARP_MAX_PAYLOAD:
                raise Malformed(f"{status_name(h.status)} response declares payload_len {h.payload_len} (> 4 GiB)")
            payload = bytearray() if h.payload_len <= keep else None
        elif isinstance(ev, PayloadChunk):
            if payload is not None:
                payload += ev.data
        else:
            break
    h = start.header
    meta, meta_error = None, ""
    if start.meta:
        try:
            meta = decode_meta(start.meta)
        except CodecError as e:
            meta_error = str(e)
    resp = Resp(h.status, start.meta, meta, h.payload_len, None if payload is None else bytes(payload), meta_error)
    if pin_stream_follows(dialect, h):
        await _read_pieces(inbox, resp, idle, until)
    return resp


def _closed_inside(dec: ResponseDecoder, start: ResponseStart | None) -> Exception:
    if dec.at_boundary:
        if not dec.buffered:
            return Closed()
        return Malformed(f"connection closed inside a response header ({dec.buffered} of 12 bytes)")
    h = dec.header
    return Malformed(f"connection closed inside a {status_name(h.status)} response "
                     f"(meta_len {h.meta_len}, payload_len {h.payload_len})")


async def _read_pieces(inbox: Inbox, resp: Resp, idle: float, until: float | None) -> None:
    resp.pieces = 0
    pieces = PieceStreamDecoder()  # its cap: a piece is a few bytes, a huge length is garbage
    loop = asyncio.get_running_loop()
    while True:
        if until is not None and loop.time() >= until:
            resp.stream_unfinished = True
            return
        try:
            data = await inbox.take_some(1 << 16, idle, until)
        except Stalled:
            if until is not None and loop.time() >= until:
                resp.stream_unfinished = True
                return
            raise
        try:
            if not data:
                pieces.eof()
                return  # the close that ends a PIN stream
            resp.pieces += len(pieces.feed(data))
        except CodecError as e:
            raise Malformed(f"PIN stream after {resp.pieces} pieces: {e}") from None


def set_nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def reset_close(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a crashing client would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class Conn:
    """A persistent Hydra connection for stateful programs and probes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.writer = writer
        self.inbox = Inbox(reader)

    @classmethod
    async def open(cls, host: str, port: int, timeout: float) -> "Conn":
        r, w = await asyncio.wait_for(asyncio.open_connection(host, port, limit=1 << 20), timeout)
        set_nodelay(w)
        return cls(r, w)

    async def request(self, data: bytes, idle: float, *, dialect: Dialect | None = None,
                      until: float | None = None) -> Resp:
        self.writer.write(data)
        await asyncio.wait_for(self.writer.drain(), idle)
        return await read_response(self.inbox, idle, dialect=dialect, until=until)

    async def close(self) -> None:
        self.writer.close()
        await self.inbox.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)
        except (OSError, TimeoutError):
            pass
