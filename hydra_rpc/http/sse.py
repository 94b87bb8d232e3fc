"""One token stream as ``text/event-stream``, shared by the OpenAI and llama-server routes.

Tokens arrive in bursts (one engine step can yield many): events are buffered and a burst goes
out in one write, since a write per token costs more than a small model's decode. A write that
waits on a client that is not reading pauses the job meanwhile (its slot says
``waiting_on: client``): tokens nobody can send would only pile up in memory.
"""
from __future__ import annotations

from typing import Any

from engine.jobs import JobHandle

from hydra_rpc.http.chat import dumps
from hydra_rpc.hydra.wire import client_behind, limit_send_buffer
from hydra_rpc.http.server.messages import Request, StreamResponse

BURST_EVENTS = 256  # write at least this often, however fast the tokens come


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


class SseStream:
    def __init__(self, request: Request, job: JobHandle):
        self.request, self.job = request, job
        self.out: list[bytes] = []  # events not written yet
        self.resp = StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                            "X-Accel-Buffering": "no"})
        self._buffer_limited = False

    async def start(self) -> None:
        """Fix the headers (after the first token: a refused job still gets a real status);
        they go out with the first write (one send, one wake-up of the client)."""
        await self.resp.prepare(self.request)

    def event(self, obj: dict[str, Any]) -> None:
        self.out.append(sse(obj))

    def burst_over(self) -> bool:
        """No more tokens are waiting (or the buffer is long enough): time to write."""
        return not self.job.has_ready_events() or len(self.out) >= BURST_EVENTS

    async def flush(self) -> None:
        if not self.out:
            return
        data = b"".join(self.out)
        self.out.clear()
        self.resp.send(data)
        transport = self.request.transport
        if not self._buffer_limited and transport is not None:
            # after the first write, not before: a syscall less on the path of the first token,
            # and the first burst is small (the stream's flow control starts with the second)
            self._buffer_limited = True
            limit_send_buffer(transport)
        blocked = transport is not None and client_behind(transport)
        if blocked:  # the job waits with its stream: tokens nobody can send would pile up
            self.job.set_client_blocked(True)
        try:
            await self.resp.drain()
        finally:
            if blocked:
                self.job.set_client_blocked(False)

    async def end(self) -> StreamResponse:
        await self.flush()
        await self.resp.write_eof()
        return self.resp
