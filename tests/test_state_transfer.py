"""Multi-MiB states through STATE_GET/STATE_PUT (the direct-receive path), pipelined and dribbled."""
from __future__ import annotations

import asyncio
import json
import random
import struct

import pytest

from codec.enums import Op, Status
from codec.framing import encode_request
from hydra_rpc.client import HydraClient
from tests.helpers import serving


@pytest.mark.asyncio
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])  # the direct-receive path swaps protocols
async def test_large_state_round_trip_with_pipelined_and_dribbled_requests(tiny_model_path, loop):
    with serving("--model", "tiny", "--no-http", "--ctx", "20000", "--slots", "2",
                 "--loop", loop, "--log-level", "WARNING") as server:
        c = await HydraClient.connect(server.host, server.port)
        rng = random.Random(3)
        tokens = [rng.randrange(3, 500) for _ in range(18000)]
        r = await c.request(Op.PREFILL, "0", struct.pack(f"<{len(tokens)}I", *tokens), timeout=120)
        assert r.ok and r.meta["n_past"] == len(tokens)
        g = await c.request(Op.STATE_GET, "0", timeout=60)
        assert g.ok and g.meta["n_past"] == len(tokens) and len(g.payload) > 4 << 20
        # STATE_PUT and a STATE_META pipelined behind it in one write: the META's bytes must
        # stay with the connection, not vanish into the state buffer.
        await c.send_raw(encode_request(Op.STATE_PUT, "1", g.payload) + encode_request(Op.STATE_META, "1"))
        p = await c.read_response()
        m = await c.read_response()
        assert p.ok and p.meta["restored"] and p.meta["n_past"] == len(tokens), p
        assert m.ok and m.meta["n_past"] == len(tokens)
        # The same blob dribbled in pieces with pauses (a slow sender) into slot 0.
        raw = encode_request(Op.STATE_PUT, "0", g.payload)
        for i in range(0, len(raw), len(raw) // 7):
            await c.send_raw(raw[i:i + len(raw) // 7])
            await asyncio.sleep(0.02)
        p = await c.read_response()
        assert p.ok and p.meta["n_past"] == len(tokens)
        # Both slots now continue identically.
        outs = []
        for slot in ("0", "1"):
            r = await c.request(Op.DECODE, slot, json.dumps({"n_predict": 8, "messages": None,
                                                              "stream": False}).encode(), timeout=60)
            assert r.ok
            outs.append(r.payload[::9])
        assert outs[0] == outs[1]
        await c.close()


@pytest.mark.asyncio
async def test_client_vanishing_mid_large_payload_leaves_server_healthy(tiny_model_path):
    with serving("--model", "tiny", "--no-http", "--log-level", "WARNING") as server:
        c = await HydraClient.connect(server.host, server.port)
        raw = encode_request(Op.STATE_PUT, "0", b"\x03" + bytes(8 << 20))
        await c.send_raw(raw[: 5 << 20])
        c.writer.transport.abort()
        c2 = await HydraClient.connect(server.host, server.port)
        r = await c2.request(Op.INFO)
        assert r.ok
        r = await c2.request(Op.STATE_PUT, "0", b"\x03" + bytes(6 << 20))  # garbage state: one ERROR
        assert r.status in (Status.ERROR, Status.BAD_REQUEST)
        assert (await c2.request(Op.STATE_META, "0")).ok
        await c2.close()


@pytest.mark.asyncio
async def test_concurrent_state_gets_share_no_bytes(tiny_model_path):
    """STATE_GET reuses one resident buffer; a second transfer in flight must get its own."""
    with serving("--model", "tiny", "--no-http", "--ctx", "20000", "--slots", "2",
                 "--log-level", "WARNING") as server:
        c = await HydraClient.connect(server.host, server.port)
        for slot, seed in (("0", 1), ("1", 2)):
            rng = random.Random(seed)
            toks = [rng.randrange(3, 500) for _ in range(16000)]
            assert (await c.request(Op.PREFILL, slot, struct.pack(f"<{len(toks)}I", *toks), timeout=120)).ok
        alone = [(await c.request(Op.STATE_GET, s, timeout=60)).payload for s in ("0", "1")]
        assert alone[0] != alone[1]
        clients = [await HydraClient.connect(server.host, server.port) for _ in range(4)]
        got = await asyncio.gather(*(cl.request(Op.STATE_GET, str(i % 2), timeout=60)
                                     for i, cl in enumerate(clients)))
        for i, r in enumerate(got):
            assert r.ok and r.payload == alone[i % 2]
        for cl in clients + [c]:
            await cl.close()
