"""The fuzzer's per-reply oracle for STATE_META: a key past the slot count reaches the slot the
engine maps it onto (modulo the count, as the C++ does), which is not a desync. And its
progress oracle: a busy slot that does not move is a hang, unless a reload is being built."""
from __future__ import annotations

import asyncio
import json

import pytest

from codec.enums import Op, Status
from codec.framing import REQUEST_HEADER_SIZE, decode_request_header, encode_response
from tools.fuzzer.cases import Outcome
from tools.fuzzer.oracles import Baseline, SentFrame, judge, progressing, slot_reached
from tools.fuzzer.responses import Resp
from tools.fuzzer.target import Target


@pytest.mark.parametrize("key, n_slots, want", [
    (b"3", 2, 1), (b"7", 4, 3), (b"1", 2, 1), (b" 5abc", 4, 1), (b"3", None, 3), (b"-1", 2, -1), (b"x", 2, None)])
def test_slot_reached(key, n_slots, want):
    assert slot_reached(key, n_slots) == want


@pytest.mark.parametrize("slot_id, desync", [(1, False), (3, True), (0, True)])
def test_state_meta_for_a_key_past_the_slots_is_judged_by_the_slot_it_reaches(slot_id, desync):
    out = Outcome()
    reply = Resp(Status.OK, b"{}", {"slot_id": slot_id}, 0, b"")
    judge(reply, SentFrame(Op.STATE_META, b"3", b""), Baseline(Status.OK, True, 1, n_slots=2), out)
    assert bool(out.failures) is desync, out.failures


class StillPeer:
    """A Hydra port whose slot 0 is busy and never moves (STATE_META), and whose INFO shows a
    reload in ``reload_state``: what a job held behind a CONFIGURE's reload looks like."""

    def __init__(self, reload_state: str):
        self.reload_state = reload_state

    async def serve(self, reader, writer) -> None:
        try:
            while True:
                head = decode_request_header(await reader.readexactly(REQUEST_HEADER_SIZE))
                await reader.readexactly(head.key_len + head.payload_len + head.trace_len)
                meta = ({"n_past": 7, "tokens_processed": 7, "is_processing": True, "operation": "decode"}
                        if head.op == Op.STATE_META else {"engine": "x", "reload": {"state": self.reload_state}})
                writer.write(encode_response(Status.OK, json.dumps(meta).encode()))
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("reload_state, moving", [("loading", True), ("swapped", False)])
async def test_a_still_slot_is_slow_while_a_reload_is_built_and_hung_otherwise(reload_state, moving):
    peer = StillPeer(reload_state)
    server = await asyncio.start_server(peer.serve, "127.0.0.1", 0)
    try:
        target = Target("127.0.0.1", server.sockets[0].getsockname()[1])
        frame = SentFrame(Op.DECODE, b"0", b"")
        assert await progressing(target, frame, deadline=2.0, window=0.3, interval=0.05) is moving
    finally:
        server.close()
        await server.wait_closed()
