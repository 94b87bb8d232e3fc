"""Progress-based read deadlines against a real server: a slow but steady link is served, a
dribbler is cut whatever its frame size.

Neither test can pass by accident on a slow host: the slow link must *succeed* (a host too slow
to keep the pace would only make it fail), and the dribbler server's stall deadline is far
longer than the dribbler's pauses, so only the minimum rate can cut it — the server's log line
names which deadline did.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from codec.enums import Op, Status
from codec.framing import encode_request_header
from hydra_rpc.client import HydraClient
from tests.helpers import log_shows, serving


async def closed_by_server(c: HydraClient, deadline: float) -> bool:
    try:
        return await asyncio.wait_for(c.reader.read(1), deadline) == b""
    except ConnectionError:
        return True


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_state_put_at_a_steady_megabyte_per_second_is_served(tiny_model_path):
    """8 MiB at 1 MiB/s with --stall-timeout 2: the old total deadline cut this after ~2 s.
    (--ctx-size 32768, one pool each slot may fill: a STATE_PUT is capped by the largest blob
    the model's slot can produce.)"""
    size, step = 8 << 20, 64 << 10
    with serving("--model", "tiny", "--no-http", "--ctx-size", "32768", "--stall-timeout", "2",
                 "--log-level", "WARNING") as sp:
        async with await HydraClient.connect(sp.host, sp.port) as c:
            await c.send_raw(encode_request_header(Op.STATE_PUT, 1, size, 0) + b"0")
            start = time.monotonic()
            for i in range(size // step):
                await asyncio.sleep(max(0.0, start + i * step / (1 << 20) - time.monotonic()))  # pacing only
                await c.send_raw(b"\x01" * step)
            r = await asyncio.wait_for(c.read_response(), 60)
            # Garbage is not a KV blob: an answer about its content means it was read to its end.
            assert r.status == Status.BAD_REQUEST and r.meta["rule"].startswith("kv."), r
            assert (await c.request(Op.INFO, timeout=10)).ok


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["header", "payload"])
async def test_a_one_byte_per_second_dribbler_is_closed(tiny_model_path, where):
    with serving("--model", "tiny", "--no-http", "--stall-timeout", "60", "--min-rate", "1024",
                 "--min-rate-window", "3", "--log-level", "INFO") as sp:
        frame = encode_request_header(Op.STATE_PUT, 1, 100, 0) + b"0" + b"\x03" * 100
        async with await HydraClient.connect(sp.host, sp.port) as c:
            if where == "payload":
                await c.send_raw(frame[:17])
                frame = frame[17:]

            async def dribble() -> None:
                for b in frame:
                    await c.send_raw(bytes([b]))
                    await asyncio.sleep(1.0)  # the dribbler's pace (the stall deadline is 60 s)

            sender = asyncio.ensure_future(dribble())
            try:
                assert await closed_by_server(c, 60)
            finally:
                sender.cancel()
        async with await HydraClient.connect(sp.host, sp.port) as ok:  # the server itself is fine
            assert (await ok.request(Op.INFO, timeout=10)).ok
    await log_shows(sp, "slower than 1024 bytes/s over 3s")
