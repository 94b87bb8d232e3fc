"""A token stream's first write: the response's headers go out with the first event, in one
write (one send, one wake-up of the client on its time to first token), not a write each; the
socket's send buffer is fixed small after it (the stream's flow control, hydra.wire.limit_send_buffer)."""
from __future__ import annotations

import asyncio
import socket

import pytest

from hydra_rpc.config import ServerConfig
from hydra_rpc.conn_budget import ConnectionBudget
from hydra_rpc.http.server.messages import Request, StreamResponse
from hydra_rpc.http.server.serve import HttpServer
from hydra_rpc.http.sse import SseStream
from hydra_rpc.hydra.wire import STREAM_SNDBUF


class _Job:  # what SseStream asks of a job handle
    def has_ready_events(self) -> bool:
        return False

    def set_client_blocked(self, blocked: bool) -> None:
        pass


@pytest.mark.timeout(30)
def test_headers_and_the_first_event_leave_in_one_write():
    # asyncio's own loop, whatever the suite runs on: its transports' writes can be wrapped
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        writes, sndbuf = runner.run(_first_stream())
    assert sndbuf in (STREAM_SNDBUF, 2 * STREAM_SNDBUF)  # Linux reports twice what was set
    first = writes[0]
    assert first.startswith(b"HTTP/1.1 200") and b"text/event-stream" in first and b'data: {"n":1}' in first


async def _first_stream() -> tuple[list[bytes], int]:
    """One stream of two events through a real server; each write its transport got, and the
    socket's SO_SNDBUF after the first."""
    writes: list[bytes] = []
    sndbuf = []

    async def handler(request: Request) -> StreamResponse:
        transport = request.transport
        write, writelines = transport.write, transport.writelines
        transport.write = lambda data: (writes.append(bytes(data)), write(data))[1]
        transport.writelines = lambda parts: (writes.append(b"".join(parts)), writelines(parts))[1]
        stream = SseStream(request, _Job())
        await stream.start()
        stream.event({"n": 1})
        await stream.flush()
        sndbuf.append(transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
        stream.event({"n": 2})
        return await stream.end()

    server = HttpServer(handler, ServerConfig(), ConnectionBudget(8, 32))
    server.listen("127.0.0.1", 0)
    port = server.address[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        body = await reader.read()
        writer.close()
    finally:
        await server.close()
    assert body.startswith(b"HTTP/1.1 200") and b'data: {"n":2}' in body
    return writes, sndbuf[0]
