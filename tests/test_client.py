"""HydraClient reads responses through the codec's decoder, never past what it was asked for."""
from __future__ import annotations

import asyncio

import pytest

from codec.enums import Op, Status
from codec.errors import Truncated
from codec.framing import encode_response
from codec.payloads import encode_piece
from hydra_rpc.client import HydraClient


async def canned(reply: bytes):
    """A loopback server that answers the first request's bytes with ``reply``, then closes."""
    async def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read(1)
        w.write(reply)
        await w.drain()
        w.close()

    return await asyncio.start_server(on_connect, "127.0.0.1", 0)


@pytest.mark.asyncio
async def test_read_head_leaves_the_payload_to_the_caller():
    payload = bytes(range(256)) * 64
    srv = await canned(encode_response(Status.OK, b'{"n":1}', payload) + encode_response(Status.BUSY))
    async with srv, await HydraClient.connect(*srv.sockets[0].getsockname()[:2]) as c:
        await c.send(Op.STATE_GET, b"0")
        hdr, meta = await c.read_head()
        assert (hdr.status, meta, hdr.payload_len) == (Status.OK, b'{"n":1}', len(payload))
        assert await c.reader.readexactly(len(payload)) == payload
        r = await c.read_response()
        assert r.status == Status.BUSY and r.meta is None and r.payload == b""


@pytest.mark.asyncio
async def test_pin_pieces_until_eof_and_a_cut_frame_is_an_error():
    pieces = [b"he", b"", "llo ✓".encode()]
    srv = await canned(encode_response(Status.OK) + b"".join(encode_piece(p) for p in pieces))
    async with srv, await HydraClient.connect(*srv.sockets[0].getsockname()[:2]) as c:
        await c.send(Op.DECODE, b"0", b'{"n_predict":3}')
        await c.read_head()
        assert [p async for p in c.pin_pieces()] == pieces
    srv = await canned(encode_response(Status.OK) + encode_piece(b"abc")[:-1])
    async with srv, await HydraClient.connect(*srv.sockets[0].getsockname()[:2]) as c:
        await c.send(Op.DECODE, b"0", b'{"n_predict":3}')
        await c.read_head()
        with pytest.raises(Truncated):
            [p async for p in c.pin_pieces()]
