"""The real server over TCP: dispatch, every error path answered and followed by a good INFO."""
from __future__ import annotations

import asyncio
import struct

import pytest

from codec.enums import Op, Status
from codec.framing import encode_request, encode_request_header
from hydra_rpc.client import HydraClient


SERVER_ARGS = ("--model", "tiny", "--no-http", "--idle-timeout", "3", "--first-bytes-timeout", "2",
               "--stall-timeout", "2", "--max-drain", str(4 << 20), "--log-level", "WARNING")


async def assert_info_ok(c: HydraClient) -> None:
    r = await c.request(Op.INFO, b"", timeout=5)
    assert r.status == Status.OK and r.meta["engine"] == "llama-server-hydra", r


@pytest.mark.asyncio
async def test_info_has_reference_keys(client):
    r = await client.request(Op.INFO)
    for key in ("engine", "version", "capabilities", "preset_aliases", "solo_active", "rpc_backend_active", "mode",
                "split_mode", "peer_addr", "peer_reachable", "layer_split", "combined_head_attached",
                "pipeline_capable", "reload", "slots_total", "slots_busy"):
        assert key in r.meta, key
    assert {"prefill", "decode", "state_transfer", "merged_decode"} <= set(r.meta["capabilities"])


@pytest.mark.asyncio
@pytest.mark.parametrize("raw, expect", [
    (encode_request(0x99, b"0", b"x" * 1000), "unknown opcode 0x99"),
    (encode_request(Op.PUT, b"k", b"store payload"), "unknown opcode 0x01"),
    (encode_request(0x23, b"0", b"abc"), "unknown opcode 0x23"),
    (encode_request(Op.STATE_META, b"abc"), "not a slot number"),
    (encode_request(Op.PREFILL, b"0", b"{not json"), "invalid JSON"),
    (encode_request(Op.SWAP_QUANT, b"", b"\xff\xff" + b"x"), "qk_len"),
    (encode_request(Op.CONFIGURE, b"", b"[1,2]"), "CONFIGURE"),
    (encode_request_header(Op.CONFIGURE, 0, 2 << 20, 0) + b"{" * (2 << 20), "exceeds the CONFIGURE limit"),
])
async def test_error_paths_answer_once_and_stay_in_sync(client, raw, expect):
    await client.send_raw(raw)
    r = await asyncio.wait_for(client.read_response(), 10)
    assert r.status in (Status.ERROR, Status.BAD_REQUEST, Status.NOT_FOUND), r
    assert expect in r.meta["error"], r.meta
    await assert_info_ok(client)


@pytest.mark.asyncio
async def test_slot_keys_map_modulo_the_slot_count_as_the_cpp_engine(client):
    n = (await client.request(Op.INFO)).meta["slots_total"]
    for key, slot in ((str(n).encode(), 0), (str(2 * n + 1).encode(), 1), (b" +%d" % (n + 1), 1)):
        r = await client.request(Op.STATE_META, key)
        assert r.status == Status.OK and r.meta["slot_id"] == slot % n, (key, r)
    r = await client.request(Op.STATE_META, b"-1")
    assert r.status == Status.NOT_FOUND and r.meta["rule"] == "key.slot"
    r = await client.request(Op.STATE_META, b"slot1")
    assert r.status == Status.ERROR and r.meta["rule"] == "key.not_numeric"
    await assert_info_ok(client)


@pytest.mark.asyncio
async def test_payload_on_no_payload_op_is_drained(client):
    r = await client.request(Op.STATE_META, b"0", b"z" * 5000)
    assert r.status == Status.OK and r.meta["slot_id"] == 0
    await assert_info_ok(client)


@pytest.mark.asyncio
async def test_huge_payload_len_is_refused_without_allocating(server):
    """1 TiB claimed: one ERROR, then a close (too large to drain); RSS stays flat."""
    def rss_kib() -> int:
        with open(f"/proc/{server.proc.pid}/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS")).split()[1])

    before = rss_kib()
    c = await HydraClient.connect(server.host, server.port)
    await c.send_raw(encode_request_header(Op.STATE_PUT, 1, 1 << 40, 0) + b"0" + b"\x03" * 4096)
    r = await asyncio.wait_for(c.read_response(), 10)
    assert r.status == Status.ERROR and "exceeds" in r.meta["error"]
    assert await asyncio.wait_for(c.reader.read(1), 5) == b""  # closed
    await c.close()
    assert rss_kib() - before < 50 * 1024
    c2 = await HydraClient.connect(server.host, server.port)
    await assert_info_ok(c2)
    await c2.close()


@pytest.mark.asyncio
async def test_bad_magic_closes_without_reply(server):
    for first in (b"\x48\x59", b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\x00"):
        r, w = await asyncio.open_connection(server.host, server.port)
        w.write(first + bytes(20))
        await w.drain()
        assert await asyncio.wait_for(r.read(100), 5) == b""
        w.close()


@pytest.mark.asyncio
async def test_ggml_first_byte_without_upstream_is_closed(server):
    r, w = await asyncio.open_connection(server.host, server.port)
    w.write(b"\x0e" + struct.pack("<Q", 24) + bytes(24))
    await w.drain()
    assert await asyncio.wait_for(r.read(100), 5) == b""
    w.close()


@pytest.mark.asyncio
async def test_silent_connection_closed_at_deadline(server):
    r, w = await asyncio.open_connection(server.host, server.port)
    assert await asyncio.wait_for(r.read(1), 10) == b""
    w.close()


@pytest.mark.asyncio
async def test_idle_and_stalled_connections_are_closed(server):
    c = await HydraClient.connect(server.host, server.port)
    await assert_info_ok(c)
    assert await asyncio.wait_for(c.reader.read(1), 10) == b""  # idle timeout 3 s
    await c.close()
    c = await HydraClient.connect(server.host, server.port)
    await c.send_raw(encode_request(Op.INFO)[:9])  # half a header, then nothing
    assert await asyncio.wait_for(c.reader.read(1), 10) == b""  # stall timeout 2 s
    await c.close()


@pytest.mark.asyncio
async def test_byte_by_byte_request(client):
    for b in encode_request(Op.STATE_META, b"1", b"", b"trace-x"):
        await client.send_raw(bytes([b]))
    r = await client.read_response()
    assert r.status == Status.OK and r.meta["slot_id"] == 1


@pytest.mark.asyncio
async def test_pipelined_requests_answered_in_order(client):
    await client.send_raw(b"".join(encode_request(Op.STATE_META, str(i).encode()) for i in range(4)))
    for i in range(4):
        r = await client.read_response()
        assert r.meta["slot_id"] == i
