"""Fields a client can get wrong, on the fleet's model kind (tiny-hybrid), as ``hydra-rpc fuzz``
found them: each is one well-formed refusal before anything runs, never an internal error,
and the server goes on serving.

* an unpaired UTF-16 surrogate escape (``"\\ud800"``) in any JSON string: nlohmann (the C++
  engine, llama-server) refuses it at parse; Python kept it, and the tokenizer failed on it;
* a merged DECODE's ``stop`` of another type than a string or a list (ignored, as the
  C++ ignores it), or more stop sequences than the engine looks for (refused before the
  frame's KV segment is restored);
* a PIN DECODE whose prompt outgrows the slot: its ``OK`` is out, so the stream ends with the
  close that ends every PIN stream, and the request's log line says why (no traceback).
"""
from __future__ import annotations

import json

import aiohttp
import pytest

from codec.decode_v3 import encode_decode_v3
from codec.dialects import decode_dialect, pin_stream_follows
from codec.enums import Op, Status
from engine.jobs import MAX_STOPS
from hydra_rpc.client import HydraClient
from tests.helpers import log_shows, poll_decode, serving

LONE = '{"role": "user", "content": "\\ud800 hi"}'  # the escape as a client's JSON text has it


@pytest.fixture(scope="module")
def server():
    with serving("--model", "tiny-hybrid", "--parallel", "2", "--ctx-size", "2048") as sp:
        yield sp


async def _request(sp, op: int, key: str, payload: bytes):
    async with await HydraClient.connect(sp.host, sp.port) as c:
        return await c.request(op, key, payload, trace="hostile")


def v3_frame(generation: dict, messages: str = '[{"role": "user", "content": "hi"}]') -> bytes:
    return encode_decode_v3({"generation": {"sampling": {}, "stream": False, "n_predict": 2, **generation}},
                            messages.encode())


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("op, payload", [
    (Op.PREFILL, f'{{"messages": [{LONE}]}}'),
    (Op.DECODE, f'{{"n_predict": 2, "messages": [{LONE}]}}'),
    (Op.DECODE, f'{{"n_predict": 2, "stream": false, "messages": [{LONE}]}}'),
    (Op.PREFILL, '{"prompt": "\\udc00"}'),
])
async def test_an_unpaired_surrogate_escape_is_refused_on_the_hydra_port(server, op, payload):
    res = await _request(server, op, "0", payload.encode())
    assert res.status != Status.OK and "unpaired UTF-16 surrogate" in res.meta["error"], res
    ok = await _request(server, Op.DECODE, "1", b'{"n_predict": 2, "stream": false, "messages": '
                                                   b'[{"role": "user", "content": "hi"}]}')
    assert ok.status == Status.OK, ok


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", '{"prompt": "\\ud800abc", "max_tokens": 2}'),
    ("/v1/chat/completions", f'{{"messages": [{LONE}], "max_tokens": 2, "stream": true}}'),
    ("/completion", '{"prompt": "x", "n_predict": 2, "stop": ["\\udfff"]}'),
    ("/tokenize", '{"content": "\\ud800"}'),
])
async def test_an_unpaired_surrogate_escape_is_a_400_over_http(server, path, body):
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.http_port}") as http:
        async with http.post(path, data=body, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400, await r.text()
            assert "unpaired UTF-16 surrogate" in (await r.json())["error"]["message"]
        async with http.post("/v1/completions", json={"prompt": "😀 hi", "max_tokens": 2}) as r:
            assert r.status == 200, await r.text()  # a pair, as Python's json.dumps escapes it, is fine


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", [7, 1.5, {"a": 1}, None, [3, "x"]])
async def test_a_merged_decodes_stop_of_another_type_is_ignored(server, stop):
    res = await _request(server, Op.DECODE, "0", v3_frame({"stop": stop}))
    assert res.status == Status.OK and res.meta["valid"] is True, res
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.http_port}") as http:
        done = await poll_decode(http, res.meta["decode_request_id"])  # the slot is free for the next case
    assert done["status"] == "done" and "internal error" not in server.log, done


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", [["s"] * (MAX_STOPS + 1), ["x" * 257]])
async def test_a_merged_decode_with_stops_the_engine_cannot_look_for_is_refused(server, stop):
    res = await _request(server, Op.DECODE, "0", v3_frame({"stop": stop}))
    assert res.status != Status.OK and res.meta["rule"] == "v3.stop", res


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_pin_prompt_longer_than_the_slot_ends_its_stream_and_the_log_says_why(server):
    words = " ".join(f"w{i}" for i in range(6000))  # more tokens than a slot's 1024
    payload = json.dumps({"n_predict": 4, "messages": [{"role": "user", "content": words}]}).encode()
    async with await HydraClient.connect(server.host, server.port) as c:
        await c.send(Op.DECODE, "0", payload, trace="pin-too-long")
        head, meta = await c.read_head()
        assert pin_stream_follows(decode_dialect(payload), head), (head, meta)
        assert [p async for p in c.pin_pieces()] == []
    log = await log_shows(server, "trace=pin-too-long")
    line = next(text for text in log.splitlines() if "trace=pin-too-long" in text)
    assert "the engine ended the stream" in line and "does not fit the slot context" in line, line
    assert "handler failed" not in server.log and "Traceback" not in server.log, server.log[-3000:]
