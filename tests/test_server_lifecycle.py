"""Connection limit, allow-list, graceful and forced shutdown, loops, and `hydra-rpc call`."""
from __future__ import annotations

import asyncio
import json
import re
import signal

import pytest

from codec.enums import Op, Status
from hydra_rpc.client import HydraClient
from tests.helpers import start_server

USER = [{"role": "user", "content": "hello"}]


async def closed_by_server(c: HydraClient) -> bool:
    return await eof_or_reset(c.reader)


async def eof_or_reset(reader: asyncio.StreamReader) -> bool:
    """EOF or a reset: either way the server closed without answering."""
    try:
        return await asyncio.wait_for(reader.read(1), 5) == b""
    except ConnectionResetError:
        return True


@pytest.mark.asyncio
async def test_connection_limit_answers_busy(tiny_model_path):
    server = start_server("--model", "tiny", "--no-http", "--max-connections", "2", "--log-level", "WARNING")
    try:
        a = await HydraClient.connect(server.host, server.port)
        b = await HydraClient.connect(server.host, server.port)
        assert (await a.request(Op.INFO)).ok and (await b.request(Op.INFO)).ok
        c = await HydraClient.connect(server.host, server.port)
        r = await c.request(Op.INFO)
        assert r.status == Status.BUSY and "connection limit" in r.meta["error"]
        assert await closed_by_server(c)
        await c.close()
        await b.close()
        # b's place frees once the server has seen it close: until then a newcomer is still refused.
        async with asyncio.timeout(30):
            while True:
                d = await HydraClient.connect(server.host, server.port)
                if (await d.request(Op.INFO)).ok:
                    break
                await d.close()
                await asyncio.sleep(0.02)
        for x in (a, d):
            await x.close()
    finally:
        assert server.stop() == 0, server.log


@pytest.mark.asyncio
async def test_allow_list_refuses_other_networks(tiny_model_path):
    server = start_server("--model", "tiny", "--no-http", "--allow", "10.0.0.0/8")
    try:
        c = await HydraClient.connect(server.host, server.port)
        await c.send(Op.INFO)
        assert await closed_by_server(c)
        await c.close()
        await asyncio.to_thread(server.wait_for, re.compile("not in --allow"), 30)  # the log comes through a pipe
    finally:
        server.stop()
    server = start_server("--model", "tiny", "--no-http", "--allow", "127.0.0.0/8", "--log-level", "WARNING")
    try:
        c = await HydraClient.connect(server.host, server.port)
        assert (await c.request(Op.INFO)).ok
        await c.close()
    finally:
        assert server.stop() == 0


@pytest.mark.asyncio
async def test_a_client_repeating_an_unknown_protocol_is_logged_once_a_minute(tiny_model_path):
    """A health check aimed at the wrong port, a ggml-RPC client retrying: every connection is
    closed, one line says so for each (the next after a minute, with the count left out)."""
    server = start_server("--model", "tiny", "--no-http")
    try:
        # an HTTP probe, and a llama.cpp RPC client while the passthrough is off, five times each
        for first_bytes in [b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"] * 5 + [b"\x0e" + bytes(8)] * 5:
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(first_bytes)
            assert await eof_or_reset(reader)
            writer.close()
        c = await HydraClient.connect(server.host, server.port)
        assert (await c.request(Op.INFO)).ok
        await c.close()
    finally:
        assert server.stop() == 0
    assert len(re.findall(r"unknown protocol, first bytes 47 45 54", server.log)) == 1, server.log
    assert len(re.findall(r"passthrough is off", server.log)) == 1, server.log


@pytest.fixture
def small_model():
    from engine.model_files import ensure_tiny_model

    return str(ensure_tiny_model("small"))


@pytest.mark.asyncio
async def test_graceful_shutdown_finishes_the_request_in_flight(small_model):
    server = start_server("--model", small_model, "--no-http", "--shutdown-timeout", "120", "--log-level", "WARNING")
    c = await HydraClient.connect(server.host, server.port)
    idle = await HydraClient.connect(server.host, server.port)
    assert (await idle.request(Op.INFO)).ok
    body = {"n_predict": 300, "messages": USER, "stream": False}
    task = asyncio.create_task(c.request(Op.DECODE, "0", json.dumps(body).encode(), timeout=60))
    poll = await HydraClient.connect(server.host, server.port)
    async with asyncio.timeout(20):
        while not (await poll.request(Op.STATE_META, "0")).meta["is_processing"]:
            await asyncio.sleep(0.005)
    await poll.close()
    server.proc.send_signal(signal.SIGINT)
    r = await task  # the server waits for it before stopping
    assert r.ok and r.meta["tokens_generated"] > 0
    assert await closed_by_server(idle)  # idle connection closed at once
    rc = await asyncio.to_thread(server.proc.wait, 20)
    assert rc == 0
    server.stop()
    assert "stopped" in server.log
    await c.close()
    await idle.close()


@pytest.mark.asyncio
async def test_second_signal_forces_exit(small_model):
    server = start_server("--model", small_model, "--no-http", "--ctx", "16384", "--shutdown-timeout", "600",
                          "--log-level", "WARNING")
    c = await HydraClient.connect(server.host, server.port)
    poll = await HydraClient.connect(server.host, server.port)
    try:
        await c.send(Op.DECODE, "0", json.dumps({"n_predict": 16000, "messages": USER, "stream": False}).encode())
        async with asyncio.timeout(20):
            while not (await poll.request(Op.STATE_META, "0")).meta["is_processing"]:
                await asyncio.sleep(0.005)
        server.proc.send_signal(signal.SIGINT)
        await listening_socket_closed(server.host, server.port)
        server.proc.send_signal(signal.SIGINT)
        # Forced: the request in flight is cancelled, its connection closed without a response
        # (a graceful shutdown would have waited up to 600 s and sent it).
        assert await closed_without_response(c)
        rc = await asyncio.to_thread(server.proc.wait, 20)
        assert rc == 0
        server.stop()
        assert "forcing exit" in server.log
    finally:
        server.stop()
        await c.close()
        await poll.close()


async def listening_socket_closed(host: str, port: int) -> None:
    """Wait until a connect is refused. A connect that raced the close sat in the accept backlog
    and is reset when the listening socket goes: that also means closed."""
    async with asyncio.timeout(20):
        while True:
            try:
                (await asyncio.open_connection(host, port))[1].close()
            except (ConnectionRefusedError, ConnectionResetError):
                return
            await asyncio.sleep(0.01)


async def closed_without_response(c: HydraClient) -> bool:
    try:
        return await c.reader.read(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.asyncio
async def test_asyncio_loop_option(tiny_model_path):
    server = start_server("--model", "tiny", "--no-http", "--loop", "asyncio", "--log-level", "WARNING")
    try:
        c = await HydraClient.connect(server.host, server.port)
        assert (await c.request(Op.STATE_META, "0")).ok
        await c.close()
    finally:
        assert server.stop() == 0
