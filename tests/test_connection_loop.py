"""The connection loop over an in-memory transport: bytes in any split, responses out, no sockets.

Handlers here are small fakes (echo, sink, slow reader): what is under test is the framing,
the refusals, backpressure and the one-response-per-request promise, not the engine.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from codec.decoder import ResponseDecoder, ResponseEnd, ResponseStart
from codec.decoder import PayloadChunk
from codec.enums import Op, Status
from codec.framing import encode_request, encode_request_header
from codec.errors import MalformedPayload
from codec.limits import Limits
from codec.payloads import decode_meta
from hydra_rpc.config import ServerConfig
from hydra_rpc.hydra.connection import HydraConnection
from tests.memory_transport import MemoryTransport

ECHO = Op.CONFIGURE  # payload echoed back with key and trace in the meta
SINK = Op.STATE_PUT  # payload received with read_into, its length and checksum answered
HOLD = Op.PREFILL  # reads nothing until released


class Fakes:
    def __init__(self):
        self.release = asyncio.Event()
        self.seen_peer_gone: list[bool] = []
        self.late_running = False

    def table(self):
        return {int(ECHO): self.echo, int(SINK): self.sink, int(Op.INFO): self.info, int(HOLD): self.hold,
                int(Op.DECODE): self.boom, int(Op.SWAP_QUANT): self.silent, int(Op.STATE_GET): self.big,
                int(Op.STATE_META): self.refuse_late}

    async def echo(self, req, resp):
        data = await req.body.read_all()
        await resp.send(Status.OK, {"key": req.key.decode(), "trace": req.trace}, bytes(data))

    async def sink(self, req, resp):
        buf = bytearray(req.body.length)
        await req.body.read_into(buf)
        await resp.send(Status.OK, {"n": len(buf), "sum": sum(buf) & 0xFFFFFFFF})

    async def info(self, req, resp):
        await resp.send(Status.OK, {"engine": "fake"})

    async def hold(self, req, resp):
        await self.release.wait()
        await resp.send(Status.OK, {"n": len(await req.body.read_all())})

    async def boom(self, req, resp):
        raise RuntimeError("a bug")

    async def silent(self, req, resp):
        pass

    async def refuse_late(self, req, resp):
        """Refuses its payload once released (a STATE_PUT whose blob fails to parse)."""
        self.late_running = True
        await self.release.wait()
        raise MalformedPayload("bad blob", rule="test.late")

    async def big(self, req, resp):
        await resp.start(Status.OK, None, 3 << 20)
        for _ in range(3):
            await resp.write(b"\x07" * (1 << 20))


def responses(raw: bytes) -> list[tuple[int, dict | None, bytes]]:
    dec = ResponseDecoder(Limits())
    dec.feed(raw)
    out, payload, head = [], b"", None
    for ev in dec.events():
        if isinstance(ev, ResponseStart):
            head, payload = ev, b""
        elif isinstance(ev, PayloadChunk):
            payload += ev.data
        elif isinstance(ev, ResponseEnd):
            out.append((head.header.status, decode_meta(head.meta), payload))
    assert dec.buffered == 0 and dec.at_boundary, "a response was cut"
    return out


class Harness:
    def __init__(self, limits: Limits | None = None, **cfg):
        self.fakes = Fakes()
        self.cfg = ServerConfig(limits=limits or Limits(), **cfg)
        self.conn = HydraConnection(self.cfg, self.fakes.table(), 1, "test", None)
        self.t = MemoryTransport(self.conn)
        self.task = asyncio.ensure_future(self.conn.serve())

    async def until(self, cond, what: str) -> None:
        """Run the loop until ``cond()`` holds (no clock involved: a bounded number of turns)."""
        for _ in range(10_000):
            if cond():
                return
            await asyncio.sleep(0)
        raise AssertionError(f"never happened: {what}")

    async def exchange(self, data: bytes, n: int, pieces: list[int] | None = None):
        got = bytearray()
        self.t.feed(data, pieces)

        def done() -> bool:
            got.extend(self.t.take_written())
            try:
                return len(responses(bytes(got))) >= n
            except AssertionError:
                return False

        await self.until(done, f"{n} responses")
        return responses(bytes(got))

    async def close(self) -> None:
        self.t.close()
        await asyncio.wait_for(self.task, 5)


def splits(total: int, rng: random.Random) -> list[int]:
    out, left = [], total
    while left > 0:
        n = rng.choice((1, 2, 3, 5, 11, 16, 17, 100, 4096))
        out.append(n)
        left -= n
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(8))
async def test_pipelined_requests_in_any_split_get_one_response_each_in_order(seed):
    rng = random.Random(seed)
    h = Harness(Limits(buffer_threshold=300))
    reqs, want = [], []
    for i in range(12):
        kind = rng.choice(("echo", "info", "sink", "info+payload"))
        payload = rng.randbytes(rng.choice((0, 1, 50, 299, 300, 301, 5000)))
        if kind == "echo":
            reqs.append(encode_request(ECHO, str(i), payload, f"t{i}"))
            want.append((Status.OK, {"key": str(i), "trace": f"t{i}"}, payload))
        elif kind == "sink":
            reqs.append(encode_request(SINK, b"0", payload))
            want.append((Status.OK, {"n": len(payload), "sum": sum(payload)}, b""))
        elif kind == "info":
            reqs.append(encode_request(Op.INFO))
            want.append((Status.OK, {"engine": "fake"}, b""))
        else:  # a payload on an op that takes none is skipped, the request served
            reqs.append(encode_request(Op.INFO, b"", payload))
            want.append((Status.OK, {"engine": "fake"}, b""))
    stream = b"".join(reqs)
    got = await h.exchange(stream, len(want), splits(len(stream), rng))
    assert got == want
    assert h.conn.requests == len(want)
    await h.close()


@pytest.mark.asyncio
async def test_refusals_answer_once_and_keep_the_stream_in_sync():
    h = Harness(Limits(max_key_len=8, max_payload={int(ECHO): 100}))
    info = encode_request(Op.INFO)
    stream = (encode_request(0x99, b"0", b"x" * 50) + info
              + encode_request(ECHO, b"k" * 9, b"abc") + info
              + encode_request(ECHO, b"0", b"y" * 101) + info
              + encode_request(Op.PUT, b"k", b"store") + info)
    got = await h.exchange(stream, 8, [1] * len(stream))
    errors = [m["error"] for st, m, _ in got[0::2]]
    assert [st for st, _, _ in got] == [Status.ERROR, Status.OK] * 4
    assert errors[0] == "unknown opcode 0x99" and errors[3] == "unknown opcode 0x01"
    assert "key_len 9/trace_len 0 over the limit 8" in errors[1]
    assert "exceeds the CONFIGURE limit of 100 bytes" in errors[2]
    await h.close()


@pytest.mark.asyncio
async def test_a_frame_too_large_to_drain_is_answered_then_closed():
    h = Harness(Limits(max_drain=1000, max_payload={int(ECHO): 100}))
    got = await h.exchange(encode_request_header(ECHO, 1, 5000, 0) + b"0" + b"z" * 64, 1)
    assert got[0][0] == Status.ERROR and "too large to drain, closing the connection" in got[0][1]["error"]
    await asyncio.wait_for(h.task, 5)
    assert h.t.closed


@pytest.mark.asyncio
async def test_bad_magic_closes_without_a_reply():
    h = Harness()
    h.t.feed(b"YH" + encode_request(Op.INFO)[2:] + b"\x48\x59" + bytes(14))
    await asyncio.wait_for(h.task, 5)
    assert h.t.closed and len(responses(h.t.take_written())) == 1


@pytest.mark.asyncio
async def test_handler_bugs_and_silence_are_answered():
    h = Harness()
    stream = encode_request(Op.DECODE, b"0", b"{}") + encode_request(Op.SWAP_QUANT) + encode_request(Op.INFO)
    got = await h.exchange(stream, 3)
    assert got[0][0] == Status.ERROR and got[0][1]["error"] == "internal error: RuntimeError: a bug"
    assert got[1][0] == Status.ERROR and got[1][1]["error"] == "handler produced no response"
    assert got[2][0] == Status.OK
    await h.close()


@pytest.mark.asyncio
async def test_large_payload_lands_in_the_handler_buffer_in_any_split():
    h = Harness(Limits(buffer_threshold=64))
    payload = random.Random(5).randbytes(300_000)
    req = encode_request(SINK, b"0", payload)
    got = await h.exchange(req + encode_request(Op.INFO), 2, [7, 1, 1, 9000, 3] + [65536] * 10)
    assert got[0] == (Status.OK, {"n": len(payload), "sum": sum(payload)}, b"")
    assert got[1][0] == Status.OK
    await h.close()


@pytest.mark.asyncio
async def test_reading_pauses_while_an_unread_payload_piles_up_and_resumes():
    h = Harness(Limits(buffer_threshold=1000))
    payload = b"p" * (600 << 10)
    h.t.feed(encode_request(HOLD, b"0", payload) + encode_request(Op.INFO))
    await h.until(lambda: not h.t.reading, "reading paused")
    assert h.conn.decoder.buffered < len(payload)  # not everything was taken in
    h.fakes.release.set()
    got = await h.exchange(b"", 2)
    assert got == [(Status.OK, {"n": len(payload)}, b""), (Status.OK, {"engine": "fake"}, b"")]
    await h.close()


@pytest.mark.asyncio
async def test_writer_waits_while_the_transport_is_above_its_high_water_mark():
    h = Harness()
    h.t.feed(encode_request(Op.STATE_GET, b"0"))
    await h.until(lambda: h.conn._write_paused, "writing paused")  # noqa: SLF001
    assert len(h.t.written) < 12 + (3 << 20)  # the handler waits: the rest is not written yet
    out = bytearray()  # the client reads; each read lets the handler write more
    await h.until(lambda: out.extend(h.t.take_written()) or len(out) >= 12 + (3 << 20), "everything written")
    assert responses(bytes(out)) == [(Status.OK, None, b"\x07" * (3 << 20))]
    await h.close()


@pytest.mark.asyncio
async def test_half_close_sets_peer_gone_after_the_pipelined_requests_are_served():
    h = Harness()
    h.t.feed(encode_request(Op.INFO) * 2)
    h.t.feed_eof()
    await asyncio.wait_for(h.task, 5)
    assert h.conn.peer_gone.is_set()
    assert [st for st, _, _ in responses(h.t.take_written())] == [Status.OK, Status.OK]


@pytest.mark.asyncio
async def test_close_mid_frame_ends_the_connection_without_a_reply():
    h = Harness()
    h.t.feed(encode_request(ECHO, b"0", b"abcdef")[:-2])
    h.t.feed_eof()
    await asyncio.wait_for(h.task, 5)
    assert h.t.take_written() == b""


@pytest.mark.asyncio
async def test_a_refusal_for_a_client_that_left_is_not_a_traceback(caplog):
    """The client resets while its request runs; the refusal then has nobody to go to: the
    connection ends quietly (the fuzzer logged a RuntimeError from the closed transport)."""
    h = Harness()
    h.t.feed(encode_request(Op.STATE_META, b"0"))
    await h.until(lambda: h.fakes.late_running, "the request running")
    h.t.close()  # the reset: the transport is closing before the handler answers
    h.fakes.release.set()
    await asyncio.wait_for(h.task, 5)
    assert "Traceback" not in caplog.text and "handler failed" not in caplog.text
