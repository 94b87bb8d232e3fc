"""The HTTP port as Hydra Core calls it (docs/http.md): ``GET /slots`` as its health poll and
stuck-slot counter read it, ``model_hash`` for its cross-model guard, ``/models/load``,
HTTP state transfer and chat completions with ``id_slot``, ``stream_options`` and
``n_predict: 0``. A real server with the tiny model; plain aiohttp as the client."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json

import aiohttp
import pytest

from codec.enums import Op, Status
from hydra_rpc.client import HydraClient
from tests.helpers import LONG_CHAT, long_chat, poll_until, serving

HELLO = LONG_CHAT["messages"]
SERVER_ARGS = ("--model", "tiny", "--slots", "4", "--threads", "1", "--log-level", "WARNING")


async def get_json(http: aiohttp.ClientSession, path: str):
    async with http.get(path) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def slot_entry(http: aiohttp.ClientSession, slot: int) -> dict:
    slots = await get_json(http, "/slots")
    assert isinstance(slots, list)  # Hydra Core's warm check needs a top-level array
    return next(s for s in slots if s["id"] == slot)


async def poll_slots(http: aiohttp.ClientSession, slot: int, pred) -> dict:
    return await poll_until(lambda: slot_entry(http, slot), pred)


# ---------------------------------------------------------------- /slots
@pytest.mark.asyncio
async def test_slots_entries_carry_llama_server_keys_and_top_level_counters(http):
    slots = await get_json(http, "/slots")
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    for s in slots:
        assert {"id", "id_task", "n_ctx", "speculative", "is_processing", "params", "next_token", "n_past",
                "n_remain", "n_decoded", "queued", "operation", "waiting_on"} <= s.keys()
        for key in ("id", "id_task", "n_ctx", "n_past", "n_remain", "n_decoded"):
            assert type(s[key]) is int, key  # System.Text.Json: ints must be ints
        assert s["next_token"][0].keys() == {"has_next_token", "has_new_line", "n_remain", "n_decoded"}


@pytest.mark.asyncio
async def test_a_long_generation_shows_a_falling_non_zero_n_remain(http):
    async with long_chat(http, 0):
        first = await slot_entry(http, 0)
        second = await poll_slots(http, 0, lambda s: s["n_remain"] < first["n_remain"])
    for s in (first, second):
        assert s["is_processing"] and s["n_remain"] > 0  # never 0 while busy: not counted as stuck
        assert s["next_token"][0]["n_remain"] == s["n_remain"] and s["next_token"][0]["has_next_token"]
        assert s["id_task"] >= 0 and s["params"]["n_predict"] == 4000 and s["params"]["temperature"] == 0
    assert second["n_decoded"] > first["n_decoded"]
    done = await slot_entry(http, 0)
    assert not done["is_processing"] and done["n_remain"] == 0 and done["id_task"] == -1


# ---------------------------------------------------------------- model_hash
async def model_hashes(http: aiohttp.ClientSession, client, slot: int) -> dict[str, str]:
    """model_hash as every reply that carries it reports it (PREFILL fills ``slot``)."""
    prefill = await client.request(Op.PREFILL, str(slot), json.dumps({"messages": HELLO}).encode())
    state_get = await client.request(Op.STATE_GET, str(slot))
    assert prefill.status == Status.OK and state_get.status == Status.OK
    models = await get_json(http, "/v1/models")
    return {
        "prefill": prefill.meta["model_hash"],
        "state_get": state_get.meta["model_hash"],
        "state_meta": (await client.request(Op.STATE_META, str(slot))).meta["model_hash"],
        "http_state_meta": (await get_json(http, f"/slots/{slot}/state/meta"))["model_hash"],
        "slots": (await slot_entry(http, slot))["model_hash"],
        "info": (await client.request(Op.INFO, b"")).meta["model_hash"],
        "v1_models": models["data"][0]["meta"]["model_hash"],
    }


@pytest.mark.asyncio
async def test_model_hash_is_the_same_everywhere_and_is_the_files_sha256(http, client, tiny_model_path):
    hashes = await model_hashes(http, client, 2)
    with open(tiny_model_path, "rb") as f:
        want = hashlib.sha256(f.read()).hexdigest()
    assert set(hashes.values()) == {want}, hashes


# ---------------------------------------------------------------- /models/load
async def post_json(http: aiohttp.ClientSession, path: str, body: dict) -> tuple[int, dict]:
    async with http.post(path, json=body) as r:
        return r.status, await r.json()


async def model_status(http: aiohttp.ClientSession) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in (await get_json(http, "/models"))["data"]}


@pytest.mark.asyncio
async def test_models_load_swaps_to_an_alias_while_another_slot_keeps_generating(tiny_model_path,
                                                                                  tiny_model_b_path):
    def sha(path: str) -> str:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    with serving("--model", "tiny", "--model-alias", "b=tiny-b", "--slots", "2", "--threads", "1",
                 "--log-level", "WARNING") as sp:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{sp.http_port}") as http:
            client = await HydraClient.connect(sp.host, sp.port)
            try:
                assert await model_status(http) == {"hydra-tiny-a": "loaded", "b": "unloaded"}
                before = await model_hashes(http, client, 1)
                assert set(before.values()) == {sha(tiny_model_path)}
                status, body = await post_json(http, "/models/load", {"model": "nope"})
                assert status == 404 and body["error"]["message"] == "model is not found"
                async with long_chat(http, 0):  # the reload drains while slot 0 generates
                    status, body = await post_json(http, "/models/load", {"model": "b"})
                    assert status == 200 and body["success"] is True and body["status"] == "loading"
                    at_load = await slot_entry(http, 0)
                    assert (await model_status(http))["b"] == "loading"
                    # unload takes back a load that has not happened yet; load again
                    status, body = await post_json(http, "/models/unload", {"model": "b"})
                    assert status == 200 and body["success"] is True
                    assert (await model_status(http))["b"] == "unloaded"
                    status, body = await post_json(http, "/models/load", {"model": "b"})
                    assert status == 200 and body["success"] is True
                    # service did not stop: slot 0 keeps generating on the old model meanwhile
                    later = await poll_slots(http, 0, lambda s: s["n_decoded"] > at_load["n_decoded"])
                    assert later["is_processing"] and later["model_name"] == "hydra-tiny-a"
                async with asyncio.timeout(60):
                    while (await model_status(http))["b"] != "loaded":
                        await asyncio.sleep(0.01)
                after = await model_hashes(http, client, 1)
                assert set(after.values()) == {sha(tiny_model_b_path)} != set(before.values()), after
                status, body = await post_json(http, "/models/load", {"model": "b"})  # already loaded
                assert status == 200 and body["success"] is True and body["status"] == "loaded"
                status, body = await post_json(http, "/models/unload", {"model": "b"})
                assert status == 409 and "resident" in body["error"]["message"]
            finally:
                await client.close()


# ---------------------------------------------------------------- HTTP state transfer
async def complete(http: aiohttp.ClientSession, slot: int, prompt: str, n: int) -> dict:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "id_slot": slot}
    async with http.post("/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


@pytest.mark.asyncio
async def test_get_state_then_put_state_into_another_slot_continues_identically(http, client):
    prompt = "the quick brown fox"
    pre = await complete(http, 0, prompt, 0)  # n_predict 0: prefill only
    n_prompt = pre["usage"]["prompt_tokens"]
    async with http.get("/slots/0/state") as r:
        assert r.status == 200 and r.content_type == "application/octet-stream"
        blob = await r.read()
        assert int(r.headers["Content-Length"]) == int(r.headers["X-Hydra-State-Size"]) == len(blob)
        assert int(r.headers["X-Hydra-N-Past"]) == n_prompt
    binary = await client.request(Op.STATE_GET, b"0")
    assert blob[0] == 3 and blob == binary.payload  # the very blob STATE_GET sends
    async with http.put("/slots/1/state", params={"erase_existing": "true"}, data=blob,
                        headers={"Content-Type": "application/octet-stream"}) as r:
        put = await r.json()
        assert r.status == 200, put
    assert list(put)[:3] == ["restored", "n_past", "bytes"]
    assert put["restored"] is True and put["n_past"] == n_prompt and 0 < put["bytes"] < len(blob)
    meta = await get_json(http, "/slots/1/state/meta")
    assert meta["n_past"] == n_prompt and meta["state_size"] > 0
    restored = await complete(http, 1, prompt, 16)
    async with http.post("/slots/2", params={"action": "erase"}) as r:
        assert r.status == 200
    fresh = await complete(http, 2, prompt, 16)
    assert restored["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1  # the KV was used
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert restored["choices"][0]["text"] == fresh["choices"][0]["text"] != ""
    # a v2 blob (v2 and v3 share their layout) restores too
    v2 = bytes([2]) + blob[1:]
    async with http.put("/slots/3/state", data=v2) as r:
        assert r.status == 200 and (await r.json())["blob_version"] == 2


@pytest.mark.asyncio
async def test_state_transfer_failures(http, server):
    async with long_chat(http, 0):
        async with http.get("/slots/0/state") as r:
            assert r.status == 503
        async with http.put("/slots/0/state", data=b"\x03" + bytes(64)) as r:
            assert r.status == 503 and (await r.json())["restored"] is False
    for path, status in (("/slots/-1/state", 400), ("/slots/x/state", 400)):  # 9 would be slot 9 % n
        async with http.get(path) as r:
            assert r.status == status
    async with http.put("/slots/1/state", data=b"\x03\x05\x00") as r:  # a header claiming more than exists
        body = await r.json()
        assert r.status == 400 and body["restored"] is False, body
    async with http.put("/slots/1/state", data=b"\x03" + bytes(8) + b"\x00" + b"not a llama state") as r:
        body = await r.json()  # refused before llama.cpp sees it: the seq-state header is checked
        assert r.status == 400 and body["restored"] is False and "magic" in body["error"]["message"], body
    async with http.put("/slots/1/state", data=b"\x03" + bytes(9), headers={"X-Hydra-Model-Hash": "0" * 64}) as r:
        body = await r.json()
        assert r.status == 409 and body["model_match"] is False and body["model_hash"] != "0" * 64

    async def chunks():
        yield b"\x03"

    async with http.put("/slots/1/state", data=chunks()) as r:  # no Content-Length
        assert r.status == 411
    # a declared size over the cap is refused before a byte of it is read
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    try:
        writer.write(b"PUT /slots/1/state HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000\r\n\r\n")
        assert b" 413 " in await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    assert (await get_json(http, "/health"))["status"] == "ok"


# ---------------------------------------------------------------- chat completions as Hydra Core sends them
def is_int(v) -> bool:
    return type(v) is int


async def sse_events(http: aiohttp.ClientSession, body: dict) -> list[dict]:
    """The ``data:`` events of a streamed chat, as Hydra Core reads them (``[DONE]`` left out)."""
    async with http.post("/v1/chat/completions", json=body) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        lines = [line.decode().strip() async for line in r.content]
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.asyncio
async def test_chat_honours_id_slot_and_answers_integer_usage_and_timings(http):
    body = {"messages": HELLO, "max_tokens": 5, "temperature": 0, "id_slot": 3, "model": "not-a-model-here"}
    async with http.post("/v1/chat/completions", json=body) as r:
        assert r.status == 200
        res = await r.json()
    assert res["id_slot"] == 3 and (await slot_entry(http, 3))["n_past"] > 0
    usage, timings = res["usage"], res["timings"]
    assert all(is_int(usage[k]) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    assert usage["completion_tokens"] == 5 and usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert is_int(timings["prompt_n"]) and timings["predicted_n"] == 5 and timings["predicted_ms"] >= 0


@pytest.mark.asyncio
async def test_streamed_chat_with_include_usage_ends_with_usage_and_otherwise_with_timings(http):
    body = {"messages": HELLO, "max_tokens": 6, "temperature": 0, "id_slot": 2, "stream": True}
    events = await sse_events(http, {**body, "stream_options": {"include_usage": True}})
    usage = events[-1]["usage"]  # the last data chunk supplies usage
    assert events[-1]["choices"] == [] and usage["completion_tokens"] == 6
    assert all(is_int(usage[k]) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    events = await sse_events(http, body)
    last = events[-1]  # without usage, Hydra Core falls back to timings.prompt_n / predicted_n
    assert "usage" not in last and last["choices"][0]["finish_reason"] == "length" and last["id_slot"] == 2
    assert is_int(last["timings"]["prompt_n"]) and last["timings"]["predicted_n"] == 6


@pytest.mark.asyncio
async def test_n_predict_0_prefills_without_generating(http):
    # Hydra Core's HTTP prefill fallback: the client body plus stream false, n_predict 0, id_slot, model
    body = {"messages": HELLO + [{"role": "user", "content": "and more"}], "max_tokens": 50, "stream": False,
            "n_predict": 0, "id_slot": 1, "model": "hydra-tiny-a"}
    async with http.post("/v1/chat/completions", json=body) as r:
        assert r.status == 200
        res = await r.json()
    usage = res["usage"]
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"]  # Hydra Core's session n_past
    assert res["choices"][0]["message"]["content"] == "" and res["timings"]["predicted_n"] == 0
    entry = await slot_entry(http, 1)
    assert entry["n_past"] == usage["prompt_tokens"] and entry["n_decoded"] == 0 and not entry["is_processing"]
