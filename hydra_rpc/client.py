"""A small asyncio Hydra client (used by ``hydra-rpc call``, tests, the fuzzer and benchmarks).

One connection, one request in flight (as every Hydra client). A request that is
cancelled or times out mid-response leaves the stream at an unknown offset, so the
client closes the connection rather than reading someone else's reply later
(redis-py #2624).
"""
from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass
from typing import AsyncIterator

from codec.decoder import NEED_DATA, ResponseDecoder, ResponseEnd
from codec.enums import Status, status_name
from codec.framing import ResponseHeader, encode_request
from codec.payloads import PieceStreamDecoder


@dataclass
class Response:
    status: int
    meta: dict | None
    payload: bytes
    meta_raw: bytes = b""

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    def __repr__(self) -> str:
        return f"Response({status_name(self.status)}, meta={self.meta}, payload={len(self.payload)} bytes)"


def parse_meta(raw: bytes) -> dict | None:
    if not raw:
        return None
    try:
        out = json.loads(raw)
    except ValueError:
        return {"_raw": raw.decode("utf-8", "replace")}
    return out if isinstance(out, dict) else {"_value": out}


class ReplyCut(asyncio.IncompleteReadError):
    """The server closed the connection part-way through a reply (the server's fault, or a
    port that is not Hydra's). ``received`` counts the bytes of that reply that did arrive."""

    def __init__(self, received: int, expected: int):
        super().__init__(b"", expected)
        self.received = received

    def __reduce__(self):
        return type(self), (self.received, self.expected)


class HydraClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self._busy = False
        self._reply: ResponseDecoder | None = None  # the reply whose head read_head returned

    @classmethod
    async def connect(cls, host: str = "127.0.0.1", port: int = 9503, timeout: float = 10.0) -> "HydraClient":
        async with asyncio.timeout(timeout):
            r, w = await asyncio.open_connection(host, port, limit=1 << 20)
        sock = w.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(r, w)

    async def close(self) -> None:
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), 2.0)
        except (Exception, asyncio.CancelledError):
            pass

    async def __aenter__(self) -> "HydraClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def send(self, op: int, key: str | bytes = b"", payload: bytes = b"", trace: str | bytes = b"") -> None:
        self.writer.write(encode_request(op, key, payload, trace))
        await self.writer.drain()

    async def send_raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def _next(self, dec: ResponseDecoder):
        """The next event of the response being read; never reads past that response, so the
        stream stays usable for the next one (and for a caller reading a payload or pieces)."""
        while True:
            ev = dec.next_event()
            if ev is not NEED_DATA:
                return ev
            data = await self.reader.read(dec.wanted)
            if not data:
                raise ReplyCut(dec.offset + dec.buffered, dec.wanted)
            dec.feed(data)

    async def read_head(self) -> tuple[ResponseHeader, bytes]:
        """Header and meta only; the payload (``read_payload``, or PIN's pieces) is still to be read."""
        self._reply = dec = ResponseDecoder()
        start = await self._next(dec)
        return start.header, start.meta

    async def read_payload(self) -> bytes:
        """The payload of the reply whose head ``read_head`` returned; the stream is then at the
        next reply."""
        dec, self._reply = self._reply, None
        if dec is None:
            raise RuntimeError("caller bug: read_payload without a read_head before it (one read_payload per reply)")
        chunks = []
        while not isinstance(ev := await self._next(dec), ResponseEnd):
            chunks.append(ev.data)
        return b"".join(chunks)

    async def read_response(self) -> Response:
        head, meta = await self.read_head()
        return Response(head.status, parse_meta(meta), await self.read_payload(), meta)

    async def request(self, op: int, key: str | bytes = b"", payload: bytes = b"", trace: str | bytes = b"",
                      timeout: float | None = 60.0) -> Response:
        if self._busy:
            raise RuntimeError("another request is in progress on this connection")
        self._busy = True
        try:
            async with asyncio.timeout(timeout):
                await self.send(op, key, payload, trace)
                return await self.read_response()
        except BaseException:
            self.writer.close()  # unknown stream offset now: never reuse
            raise
        finally:
            self._busy = False

    async def pin_pieces(self) -> AsyncIterator[bytes]:
        """After a head that ``codec.dialects.pin_stream_follows``: the pieces until EOF."""
        dec = PieceStreamDecoder()
        while data := await self.reader.read(1 << 16):
            for piece in dec.feed(data):
                yield piece
        dec.eof()
