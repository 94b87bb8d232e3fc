"""A token stream's first write: the response's headers go out with the first event, in one
write (one send, one wake-up of the client on its time to first token), not a write each."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from hydra_rpc.http.sse import SseStream


class _Job:  # what SseStream asks of a job handle
    def has_ready_events(self) -> bool:
        return False

    def set_client_blocked(self, blocked: bool) -> None:
        pass


@pytest.mark.timeout(30)
def test_headers_and_the_first_event_leave_in_one_write():
    # asyncio's own loop, whatever the suite runs on: its transports' writes can be wrapped
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        writes = runner.run(_first_stream())
    first = writes[0]
    assert first.startswith(b"HTTP/1.1 200") and b"text/event-stream" in first and b'data: {"n":1}' in first


async def _first_stream() -> list[bytes]:
    """One stream of two events through a real server; each write its transport got."""
    writes: list[bytes] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        transport = request.transport
        write, writelines = transport.write, transport.writelines
        transport.write = lambda data: (writes.append(bytes(data)), write(data))[1]
        transport.writelines = lambda parts: (writes.append(b"".join(parts)), writelines(parts))[1]
        stream = SseStream(request, _Job())
        await stream.start()
        stream.event({"n": 1})
        await stream.flush()
        stream.event({"n": 2})
        return await stream.end()

    app = web.Application()
    app.router.add_get("/s", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        body = await reader.read()
        writer.close()
    finally:
        await runner.cleanup()
    assert body.startswith(b"HTTP/1.1 200") and b'data: {"n":2}' in body
    return writes
