"""hydra_rpc/http/server in process: what the wire tests cannot step through — a graceful close
with an answer in flight, and idle kept-alive connections at a close."""
from __future__ import annotations

import asyncio

import pytest

from hydra_rpc.config import ServerConfig
from hydra_rpc.conn_budget import ConnectionBudget
from hydra_rpc.http.server.messages import Request, Response, StreamResponse
from hydra_rpc.http.server.serve import HttpServer

GET = b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n"


async def _read_answer(reader: asyncio.StreamReader) -> bytes:
    """One chunked or length-framed answer: its head, then its body (each chunk with its CRLF)."""
    head = await reader.readuntil(b"\r\n\r\n")
    if b"chunked" in head.lower():
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            body += await reader.readexactly(size + 2)
            if size == 0:
                return head + body
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head + await reader.readexactly(length)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_close_lets_a_stream_in_flight_finish_then_closes_its_kept_alive_connection():
    release = asyncio.Event()
    started = asyncio.Event()

    async def handler(request: Request) -> StreamResponse:
        resp = StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")  # the head said keep-alive: the close had not begun
        started.set()
        await release.wait()
        await resp.write(b"data: 2\n\n")
        await resp.write_eof()
        return resp

    server = HttpServer(handler, ServerConfig(), ConnectionBudget(8, 32))
    server.listen("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection(*server.address)
    try:
        writer.write(GET)
        await started.wait()
        closing = asyncio.create_task(server.close(timeout=3600))  # never cut: it must end by itself
        while not server.closing:  # the close's first step
            await asyncio.sleep(0)
        release.set()
        async with asyncio.timeout(20):  # only turns a connection left open into a failure
            answer = await _read_answer(reader)
            assert answer.endswith(b"data: 2\n\n\r\n\r\n")  # the last chunk read: the stream is whole
            assert await reader.read() == b""  # then the server closed it
            await closing
    finally:
        writer.close()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_close_closes_idle_kept_alive_connections_at_once_and_refuses_new_ones():
    async def handler(request: Request) -> Response:
        return Response(b"ok")

    server = HttpServer(handler, ServerConfig(), ConnectionBudget(8, 32))
    server.listen("127.0.0.1", 0)
    address = server.address
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(GET)
        assert (await _read_answer(reader)).endswith(b"ok")  # kept alive, now idle
        await server.close(timeout=3600)
        assert await reader.read() == b""
        assert not server.connections
        with pytest.raises(OSError):
            await asyncio.open_connection(*address)
    finally:
        writer.close()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_bytes_that_are_not_http_are_refused_and_logged_once_a_minute(caplog):
    async def handler(request: Request) -> Response:
        return Response(b"ok")

    server = HttpServer(handler, ServerConfig(), ConnectionBudget(8, 32))
    server.listen("127.0.0.1", 0)
    try:
        with caplog.at_level("INFO", logger="hydra_rpc.http"):
            for _ in range(5):  # a scanner's probes
                reader, writer = await asyncio.open_connection(*server.address)
                writer.write(b"\x16\x03\x01\x00\x05hello\r\n\r\n")
                assert (await reader.read()).startswith(b"HTTP/1.1 400 ")
                writer.close()
    finally:
        await server.close()
    lines = [r for r in caplog.records if "bad HTTP request" in r.getMessage()]
    assert len(lines) == 1 and server.bad_requests.left_out == 4


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_client_outside_the_allow_list_gets_a_403_on_each_request():
    import ipaddress

    from hydra_rpc.http.app import HttpApp
    from hydra_rpc.observability.metrics import Metrics

    async def ok(request: Request) -> Response:
        return Response(b"ok")

    for allow, status in ((["10.0.0.0/8"], b"403"), (["127.0.0.0/8"], b"200")):
        app = HttpApp(Metrics(), 1 << 20)
        app.router.add_get("/s", ok)
        server = HttpServer(app, ServerConfig(allow=[ipaddress.ip_network(a) for a in allow]),
                            ConnectionBudget(8, 32))
        server.listen("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection(*server.address)
        try:
            for _ in range(2):  # kept alive: the second request is refused (or served) as the first
                writer.write(GET)
                answer = await _read_answer(reader)
                assert answer.startswith(b"HTTP/1.1 " + status), answer
                assert status == b"200" or b"not in the allow list" in answer
        finally:
            writer.close()
            await server.close()
