"""The Hydra connection loop: strictly one request at a time, never out of sync.

Each request gets exactly one well-formed response. When a request cannot be
served (unknown opcode, oversized field, bad key, malformed payload) the unread
rest of it is drained — bounded by ``limits.max_drain`` and ``drain_deadline`` —
so the next header is read from the right offset. Only bad magic, or a remainder
too large to drain, closes the connection (after the error reply, in the latter case).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from codec.enums import Status, op_name, status_name
from codec.errors import BadMagic, RemoteProtocolError
from codec.framing import REQUEST_HEADER_SIZE, RequestHeader, decode_request_header
from codec.limits import NO_PAYLOAD_OPS

from .config import ServerConfig
from .logs import log_request
from .wire import Body, PeerGone, Request, ResponseWriter

log = logging.getLogger("hydra_rpc.connection")

Handler = Callable[[Request, ResponseWriter], Awaitable[None]]


class CloseConnection(Exception):
    """Stop serving this connection (after whatever response was already written)."""


class HydraConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cfg: ServerConfig,
                 handlers: dict[int, Handler], conn_id: int, peer: str, peer_gone: asyncio.Event,
                 on_request: Callable[[str, str, float, int, int], None] | None = None):
        self.reader, self.writer, self.cfg = reader, writer, cfg
        self.handlers = handlers
        self.conn_id, self.peer = conn_id, peer
        self.peer_gone = peer_gone
        self.on_request = on_request
        self.in_request = False
        self.stopping = False  # set by a graceful shutdown: finish this request, then close
        self.requests = 0

    async def serve(self, first: bytes) -> None:
        """Serve requests until the peer leaves, a deadline passes or the server stops.

        ``first`` holds the bytes the dispatcher already read (the magic).
        """
        pending = first
        try:
            while True:
                hdr_bytes = await self._read_header(pending)
                pending = b""
                if hdr_bytes is None:
                    return
                try:
                    header = decode_request_header(hdr_bytes)
                except BadMagic as e:
                    log.warning("closing: %s", e, extra={"fields": {"peer": self.peer, "conn": self.conn_id}})
                    return
                self.in_request = True
                try:
                    await self._one_request(header)
                finally:
                    self.in_request = False
                    self.requests += 1
                if self.stopping:
                    return
        except (CloseConnection, PeerGone, ConnectionError, asyncio.IncompleteReadError):
            return
        except TimeoutError:
            log.info("closing: stalled mid-frame", extra={"fields": {"peer": self.peer, "conn": self.conn_id}})
            return

    async def _read_header(self, pending: bytes) -> bytes | None:
        """Wait (idle deadline) for the next header; None on clean EOF or idle timeout."""
        need = REQUEST_HEADER_SIZE - len(pending)
        if need <= 0:
            return pending
        try:
            async with asyncio.timeout(self.cfg.idle_timeout if not pending else self.cfg.stall_timeout):
                first = await self.reader.read(need)
        except TimeoutError:
            if not pending:
                log.info("closing idle connection", extra={"fields": {"peer": self.peer, "conn": self.conn_id}})
                return None
            raise
        if not first:
            return None
        data = pending + first
        if len(data) < REQUEST_HEADER_SIZE:
            async with asyncio.timeout(self.cfg.stall_timeout):
                data += await self.reader.readexactly(REQUEST_HEADER_SIZE - len(data))
        return data

    async def _read_exact(self, n: int) -> bytes:
        if n == 0:
            return b""
        async with asyncio.timeout(self.cfg.stall_timeout):
            return await self.reader.readexactly(n)

    async def _one_request(self, h: RequestHeader) -> None:
        started = time.perf_counter()
        lim = self.cfg.limits
        resp = ResponseWriter(self.writer)
        key = b""
        trace = ""
        body = Body(self.reader, h.payload_len, self.cfg.stall_timeout)
        try:
            if h.key_len > lim.max_key_len or h.trace_len > lim.max_trace_len:
                body.remaining = h.body_len
                await self._refuse(resp, body, Status.ERROR,
                                   f"key_len {h.key_len}/trace_len {h.trace_len} over the limit "
                                   f"{lim.max_key_len}/{lim.max_trace_len}")
                return
            key = await self._read_exact(h.key_len)
            trace = (await self._read_exact(h.trace_len)).decode("utf-8", "replace")
            handler = self.handlers.get(h.op)
            if handler is None:
                await self._refuse(resp, body, Status.ERROR, f"unknown opcode 0x{h.op:02x}")
                return
            if h.op in NO_PAYLOAD_OPS:
                if h.payload_len:  # this op takes none: drain, ignore, then serve
                    if not await self._drain(body):
                        await resp.send(Status.ERROR, {"error": f"payload of {h.payload_len} bytes on "
                                                                f"{op_name(h.op)}, which takes none"})
                        raise CloseConnection
            elif h.payload_len > lim.payload_cap(h.op):
                await self._refuse(resp, body, Status.ERROR,
                                   f"payload_len {h.payload_len} exceeds the {op_name(h.op)} limit of "
                                   f"{lim.payload_cap(h.op)} bytes")
                return
            req = Request(h, key, trace, body, self.peer, self.conn_id, self.peer_gone)
            try:
                await handler(req, resp)
            except RemoteProtocolError as e:
                if resp.started:
                    raise CloseConnection from e
                await resp.send(e.status, {"error": str(e), "rule": e.rule})
            except (PeerGone, ConnectionError, CloseConnection, TimeoutError):
                raise
            except Exception as e:  # a bug of ours: answer, log, keep the connection
                log.exception("handler failed", extra={"fields": {"op": op_name(h.op), "trace": trace}})
                if resp.started:
                    raise CloseConnection from e
                await resp.send(Status.ERROR, {"error": f"internal error: {type(e).__name__}: {e}"})
            if not resp.started:
                await resp.send(Status.ERROR, {"error": "handler produced no response"})
            if not resp.complete and not resp.streaming_eof:
                raise CloseConnection  # promised bytes not written: cannot stay in sync
            if body.remaining and not await self._drain(body):
                raise CloseConnection
            if resp.close_after:
                raise CloseConnection
        finally:
            st = status_name(resp.status) if resp.status is not None else "NONE"
            log_request(op=op_name(h.op), key=key[:64].decode("utf-8", "replace"), trace=trace, status=st,
                        req_bytes=h.payload_len, resp_bytes=resp.payload_len, started=started, peer=self.peer,
                        conn=self.conn_id)
            if self.on_request:
                self.on_request(op_name(h.op), st, time.perf_counter() - started, h.payload_len, resp.payload_len)

    async def _drain(self, body: Body) -> bool:
        """Discard the unread payload; False when it is too large to drain."""
        if body.remaining > self.cfg.limits.max_drain:
            return False
        await body.drain(self.cfg.drain_deadline)
        return True

    async def _refuse(self, resp: ResponseWriter, body: Body, status: Status, message: str) -> None:
        """One error response; then drain the rest of the request, or close if it is too big."""
        drainable = body.remaining <= self.cfg.limits.max_drain
        await resp.send(status, {"error": message} if drainable else
                        {"error": message + "; too large to drain, closing the connection"})
        if not drainable:
            raise CloseConnection
        await body.drain(self.cfg.drain_deadline)
