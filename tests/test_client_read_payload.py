"""HydraClient.read_payload after read_head (what ``hydra-rpc call`` reads replies with), a reply
cut short, and ``hydra-rpc call`` against canned replies: the bytes it shows are the bytes sent."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from codec.enums import Op, Status
from codec.framing import encode_response
from hydra_rpc.client import HydraClient, ReplyCut
from tests.test_client import canned

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 30


@pytest.mark.asyncio
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("size", [0, 5, 3 << 20])  # none, one whole chunk, streamed (> buffer_threshold)
async def test_read_payload_after_read_head_then_the_next_reply(size):
    payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    srv = await canned(encode_response(Status.OK, b'{"n":1}', payload) + encode_response(Status.BUSY, b"{}"))
    async with srv, await HydraClient.connect(*srv.sockets[0].getsockname()[:2]) as c:
        await c.send(Op.STATE_GET, b"0")
        hdr, meta = await c.read_head()
        assert (hdr.status, meta, hdr.payload_len) == (Status.OK, b'{"n":1}', size)
        assert await c.read_payload() == payload
        r = await c.read_response()
        assert (r.status, r.meta, r.payload) == (Status.BUSY, {}, b"")


@pytest.mark.asyncio
@pytest.mark.timeout(TIMEOUT)
async def test_read_payload_needs_its_own_read_head():
    srv = await canned(encode_response(Status.OK))
    async with srv, await HydraClient.connect(*srv.sockets[0].getsockname()[:2]) as c:
        with pytest.raises(RuntimeError, match="caller bug"):
            await c.read_payload()
        await c.send(Op.INFO)
        await c.read_head()
        assert await c.read_payload() == b""
        with pytest.raises(RuntimeError, match="one read_payload per reply"):
            await c.read_payload()


@pytest.mark.asyncio
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("cut", [0, 5, 12, 14, 17, 30])  # in the header, the meta, the payload
async def test_a_cut_reply_says_how_much_of_it_arrived(cut):
    reply = encode_response(Status.OK, b'{"a":1}', b"p" * 20)
    srv = await canned(reply[:cut])
    async with srv, await HydraClient.connect(*srv.sockets[0].getsockname()[:2]) as c:
        await c.send(Op.STATE_GET, b"0")
        with pytest.raises(ReplyCut) as ei:
            await c.read_head()
            await c.read_payload()
    assert ei.value.received == cut
    assert isinstance(ei.value, asyncio.IncompleteReadError)  # what callers caught before


async def _call_cli(reply: bytes, *args: str) -> tuple[int, bytes, bytes]:
    srv = await canned(reply)
    host, port = srv.sockets[0].getsockname()[:2]
    async with srv:
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "hydra_rpc.cli", "call", *args, "--target", f"{host}:{port}", cwd=REPO,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await p.communicate()
    return p.returncode, out, err


@pytest.mark.asyncio
@pytest.mark.timeout(TIMEOUT)
async def test_call_shows_the_reply_header_bytes_as_received():
    reply = encode_response(Status.NOT_FOUND, b'{"error":"no slot"}', b"\x01\x02\x03")
    rc, out, err = await _call_cli(reply, "STATE_GET", "--key", "9", "-v")
    assert rc == 1, err
    assert f"< header  {reply[:12].hex(' ')}\n".encode() in err
    assert b"status=0x01(NOT_FOUND) meta_len=19 payload_len=3" in err
    assert b"< payload 01 02 03" in err and b"payload: 3 bytes  [01 02 03]" in err
    assert out == b'{\n  "error": "no slot"\n}\n'


@pytest.mark.asyncio
@pytest.mark.timeout(TIMEOUT)
async def test_call_names_a_reply_cut_short():
    reply = encode_response(Status.OK, b"{}", b"p" * 10)
    rc, out, err = await _call_cli(reply[:20], "INFO")
    assert rc == 2 and out == b""
    assert b"closed the connection after 20 bytes of the reply (is it a Hydra engine port?)" in err, err
