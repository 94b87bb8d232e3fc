"""STATE_META tells a stuck slot from a slow one in one poll (docs/protocol.md §6.2), against a
real server with the tiny model: over the binary port and ``/slots/{id}/state/meta``, during a
decode, behind a client that stopped reading, behind another job, and during a reload."""
from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest

from codec.enums import Op, Status
from hydra_rpc.client import HydraClient
from tests.helpers import LONG_CHAT, long_chat, poll_until, serving, slot_meta_http

HELLO = LONG_CHAT["messages"]
SERVER_ARGS = ("--model", "tiny", "--slots", "4", "--threads", "1", "--log-level", "WARNING")


async def poll(http: aiohttp.ClientSession, slot: int, pred) -> dict:
    return await poll_until(lambda: slot_meta_http(http, slot), pred)


@pytest.mark.asyncio
async def test_a_decoding_slot_shows_rate_eta_and_recent_progress(http, client):
    async with long_chat(http, 0):
        first = await poll(http, 0, lambda m: m["tokens_processed"] > 0 and m["tokens_per_s"] > 0)
        second = await poll(http, 0, lambda m: m["tokens_processed"] > first["tokens_processed"])
        binary = (await client.request(Op.STATE_META, b"0")).meta
        info = (await client.request(Op.INFO, b"")).meta
    for m in (first, second, binary):
        assert m["operation"] == "decode" and m["waiting_on"] is None and m["queue_position"] is None
        assert m["tokens_per_s"] > 0 and m["eta_ms"] > 0 and m["prefill_tokens_per_s"] is None
        # it progressed after it started (no threshold: the clock is not asserted on)
        assert 0 <= m["ms_since_progress"] <= m["elapsed_ms"]
    assert info["slot_states"][0] == "decode" and info["steps_per_s"] > 0 and info["tokens_per_s"] > 0
    idle = await slot_meta_http(http, 3)
    assert idle["ms_since_progress"] is None and idle["tokens_per_s"] == 0 and idle["eta_ms"] is None


async def open_unread_stream(port: int, slot: int) -> socket.socket:
    """POST a streamed chat on a socket with a tiny receive buffer, and never read the reply."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", port))
    body = json.dumps({**LONG_CHAT, "slot": slot, "stream": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    await asyncio.get_running_loop().sock_sendall(s, head + body)
    return s


@pytest.mark.asyncio
async def test_a_client_that_stopped_reading_shows_client_and_growing_silence(server, http, client):
    s = await open_unread_stream(server.http_port, 1)
    try:
        stuck = await poll(http, 1, lambda m: m["waiting_on"] == "client")
        later = await poll(http, 1, lambda m: m["ms_since_progress"] > stuck["ms_since_progress"])
        assert later["is_processing"] and later["waiting_on"] == "client"
        assert later["tokens_processed"] == stuck["tokens_processed"] < later["tokens_total"]  # paused, not done
        binary = (await client.request(Op.STATE_META, b"1")).meta
        assert binary["waiting_on"] == "client"
    finally:
        s.close()
    # the client is gone: its job is cancelled and the slot frees
    await poll(http, 1, lambda m: not m["is_processing"])


@pytest.mark.asyncio
async def test_jobs_queued_behind_another_show_queue_and_position(http):
    async def short_chat() -> int:
        async with http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, "slot": 2}) as r:
            return r.status

    async with long_chat(http, 2):
        one = asyncio.create_task(short_chat())
        m = await poll(http, 2, lambda m: m["queue_position"] == 1)
        assert m["waiting_on"] == "queue" and m["operation"] == "decode"
        two = asyncio.create_task(short_chat())
        await poll(http, 2, lambda m: m["queue_position"] == 2)
    assert await one == 200 and await two == 200


@pytest.fixture
def small_and_b(tiny_model_b_path):
    from engine.model_files import ensure_tiny_model

    return str(ensure_tiny_model("small")), tiny_model_b_path


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["serve-old", "reject"])
async def test_slots_held_by_a_pending_reload_say_reload(small_and_b, policy):
    small, model_b = small_and_b
    with serving("--model", small, "--slots", "2", "--threads", "1", "--reload-policy", policy,
                 "--log-level", "WARNING") as sp:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{sp.http_port}") as http:
            c = await HydraClient.connect(sp.host, sp.port)
            try:
                async with long_chat(http, 0) as gen:  # keeps the reload draining
                    r = await c.request(Op.CONFIGURE, b"", json.dumps({"model_path": model_b}).encode())
                    assert r.status == Status.OK and r.meta["reload"] in ("loading", "draining")
                    held = None
                    if policy == "serve-old":  # new work waits for the swap
                        held = asyncio.create_task(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                                                      "slot": 1}))
                    await poll(http, 1, lambda m: m["waiting_on"] == "reload")
                    assert (await slot_meta_http(http, 0))["waiting_on"] is None  # the draining job itself advances
                    gen.cancel()
                    if held is not None:
                        async with await held as resp:
                            assert resp.status == 200
                # swapped, nothing held
                await poll(http, 1, lambda m: m["waiting_on"] is None and m.get("model_name") == "hydra-tiny-b")
            finally:
                await c.close()


class _SlowClientSink:
    """A ByteSink whose transport's flow control pauses above 64 KiB until ``release``."""

    def __init__(self) -> None:
        self.size = 0
        self.release = asyncio.Event()
        self.transport = self

    def write(self, data) -> None:
        self.size += len(data)

    async def drain(self) -> None:
        if self.size > 65536:
            await self.release.wait()
            self.size = 0

    def get_write_buffer_size(self) -> int:
        return self.size

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return 16384, 65536

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name, default=None):
        return default


@pytest.mark.asyncio
async def test_a_pin_stream_write_tells_when_it_waits_on_the_client():
    from hydra_rpc.hydra.wire import ResponseWriter

    sink = _SlowClientSink()
    told: list[bool] = []
    resp = ResponseWriter(sink)
    await resp.start_eof_stream(Status.OK, None, client_wait=told.append)
    await resp.write(b"x" * 100)
    assert told == []  # a client that keeps up is never reported
    write = asyncio.create_task(resp.write(b"x" * 70000))
    async with asyncio.timeout(10):
        while told != [True]:
            await asyncio.sleep(0.001)
    assert not write.done()
    sink.release.set()
    await write
    assert told == [True, False]
