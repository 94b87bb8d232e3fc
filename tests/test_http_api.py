"""The HTTP side against a real server process: status routes, slots, erase, merged-DECODE
results, error objects and /metrics. Plain aiohttp for HTTP, HydraClient for the binary port."""
from __future__ import annotations

import asyncio
import io
import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from codec.decode_v3 import encode_decode_v3
from codec.enums import Op, Status
from hydra_rpc.client import HydraClient
from tests.helpers import poll_until, slot_meta_http

MAX_BODY = 1 << 20
DECODE_MAX = 4  # results kept, so eviction is cheap to reach
HELLO = [{"role": "user", "content": "hello"}]


SERVER_ARGS = ("--model", "tiny", "--slots", "4", "--threads", "1", "--log-level", "WARNING")
SERVER_ENV = {"HYDRA_HTTP_MAX_BODY": str(MAX_BODY), "HYDRA_DECODE_RESULT_MAX": str(DECODE_MAX)}


async def get_json(http: aiohttp.ClientSession, path: str) -> tuple[int, dict]:
    async with http.get(path) as r:
        return r.status, await r.json()


async def wait_idle(http: aiohttp.ClientSession, slot: int, timeout: float = 30.0) -> dict:
    _, meta = await poll_until(lambda: get_json(http, f"/slots/{slot}/state/meta"),
                               lambda reply: not reply[1]["is_processing"], timeout)
    return meta


def assert_error_object(body: dict, status: int) -> None:
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == status and isinstance(err["type"], str)
    assert "Traceback" not in json.dumps(body)


# ---------------------------------------------------------------- status routes
@pytest.mark.asyncio
async def test_health_version_models(http):
    status, h = await get_json(http, "/health")
    assert status == 200
    assert h["status"] == "ok" and h["startup_stage"] == "ready" and h["has_model"] is True
    assert h["model_name"] == "hydra-tiny-a" and h["rpc_active"] is True
    status, v = await get_json(http, "/version")
    assert status == 200 and v["version"] == "E1" and v["engine"] == "llama-server-hydra"
    status, m = await get_json(http, "/v1/models")
    assert status == 200 and m["object"] == "list"
    assert m["data"][0]["id"] == "hydra-tiny-a" and m["data"][0]["resident"] is True


@pytest.mark.asyncio
async def test_slots_lists_every_slot_and_meta_matches_state_meta(http, client):
    status, slots = await get_json(http, "/slots")
    assert status == 200 and [s["id"] for s in slots] == [0, 1, 2, 3]
    for s in slots:
        assert {"n_ctx", "n_past", "is_processing", "operation", "config_generation"} <= s.keys()
    status, meta = await get_json(http, "/slots/1/state/meta")
    r = await client.request(Op.STATE_META, b"1")
    assert status == 200 and r.status == Status.OK
    volatile = {"elapsed_ms"}
    assert {k: v for k, v in meta.items() if k not in volatile} == {k: v for k, v in r.meta.items()
                                                                    if k not in volatile}


@pytest.mark.asyncio
@pytest.mark.parametrize("path, status", [("/slots/-1/state/meta", 400), ("/slots/x/state/meta", 400),
                                          ("/slots/%C2%B2/state/meta", 400),
                                          ("/slots/" + "9" * 5000 + "/state/meta", 400), ("/no/such/route", 404),
                                          ("/v1/decode/%C2%B2", 404), ("/v1/decode/" + "1" * 5000, 404)])
async def test_unknown_slot_or_route(http, path, status):
    got, body = await get_json(http, path)
    assert got == status
    assert_error_object(body, status)


@pytest.mark.asyncio
async def test_slot_ids_map_modulo_the_slot_count_on_both_ports(http, client):
    """As the C++ engine maps a key: id 4 + k of 4 slots is slot k, over HTTP and on the Hydra port."""
    for raw, slot in (("4", 0), ("7", 3), ("99", 3)):
        status, meta = await get_json(http, f"/slots/{raw}/state/meta")
        r = await client.request(Op.STATE_META, raw.encode())
        assert status == 200 and r.status == Status.OK
        assert meta["slot_id"] == r.meta["slot_id"] == slot
    async with http.get("/slots/6/state") as r:  # the state routes too
        assert r.status == 200 and r.headers["X-Hydra-N-Past"] == str((await slot_meta_http(http, 2))["n_past"])


@pytest.mark.asyncio
async def test_erase_idle_slot_then_state_meta_shows_empty(http, client):
    async with http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "slot": 1}) as r:
        assert r.status == 200, await r.text()
    assert (await client.request(Op.STATE_META, b"1")).meta["n_past"] > 0
    async with http.post("/slots/1", params={"action": "erase"}) as r:
        body = await r.json()
        assert r.status == 200 and body["id_slot"] == 1 and body["n_erased"] > 0
    r = await client.request(Op.STATE_META, b"1")
    assert r.status == Status.OK and r.meta["n_past"] == 0
    async with http.post("/slots/9", params={"action": "erase"}) as r:  # 9 of 4 slots is slot 1, as on the Hydra port
        assert r.status == 200 and (await r.json()) == {"id_slot": 1, "n_erased": 0}
    async with http.post("/slots/1", params={"action": "dance"}) as r:
        assert r.status == 400
        assert_error_object(await r.json(), 400)
    async with http.post("/slots/1", params={"action": "save"}, json={"filename": "a.bin"}) as r:
        assert r.status == 501  # as llama-server without --slot-save-path
        assert_error_object(await r.json(), 501)


async def deferred(http) -> float:
    async with http.get("/metrics") as r:
        text = await r.text()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "llamacpp:requests_deferred")


@pytest.mark.asyncio
async def test_erase_of_a_busy_slot_is_answered_when_its_generation_ends(http):
    """As llama-server: the erase is deferred, not refused (a coordinator tolerates only 404/501).
    Greedy, so that the generation runs its 4,000 tokens: a sampled one may stop at an EOS a few
    ms after the erase is deferred, between two polls."""
    body = {"messages": HELLO, "max_tokens": 4000, "slot": 2, "stream": True, "temperature": 0}
    async with http.post("/v1/chat/completions", json=body) as stream:
        # Headers come after the first token: the slot is generating now.
        assert stream.status == 200
        erase = asyncio.create_task(http.post("/slots/2", params={"action": "erase"}))
        await poll_until(lambda: deferred(http), lambda n: n == 1)  # llama-server counts it there too
        assert not erase.done()
        stream.close()  # the client leaves mid-stream: the generation ends, then the erase runs
        r = await erase
        reply = await r.json()
        assert r.status == 200 and reply["id_slot"] == 2 and reply["n_erased"] > 0
    meta = await wait_idle(http, 2)
    assert meta["n_past"] == 0


# ---------------------------------------------------------------- bad input
@pytest.mark.asyncio
@pytest.mark.parametrize("data, status, fragment", [
    (b"{not json", 400, "invalid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"messages": []}', 400, "messages"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400, "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}', 400, "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', 400, "n=1"),
    (b'{"messages": [{"role": "user", "content": "x"}], "slot": 17}', 404, "unknown slot"),
    (b"\xff\xfe garbage", 400, "invalid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "invalid JSON"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1' + b"0" * 400 + b"}", 400, "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_k": 1' + b"0" * 30 + b"}", 400, "top_k"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stop": ["' + b"s" * 300 + b'"]}', 400, "stop"),
    (b'{"prompt": {"a": 1}}', 400, "messages"),
])
async def test_bad_chat_bodies_get_error_objects(http, data, status, fragment):
    async with http.post("/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}) as r:
        body = await r.json()
        assert r.status == status, body
        assert_error_object(body, status)
        assert fragment in body["error"]["message"]


@pytest.mark.asyncio
async def test_oversized_body_is_413(http):
    big = io.BytesIO(b'{"prompt": "' + b"a" * (MAX_BODY + 10) + b'"}')  # BytesIO: sized, not one huge write
    async with http.post("/v1/completions", data=big, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 413
        assert_error_object(await r.json(), 413)

    async def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(3):
            yield b"a" * (MAX_BODY // 2)

    async with http.post("/v1/completions", data=chunks(), headers={"Content-Type": "application/json"}) as r:
        assert r.status == 413
        assert_error_object(await r.json(), 413)
    assert (await get_json(http, "/health"))[0] == 200


@pytest.mark.asyncio
async def test_wrong_method_is_405_json(http):
    async with http.get("/v1/chat/completions") as r:
        assert r.status == 405 and "POST" in r.headers["Allow"]
        assert_error_object(await r.json(), 405)
    async with http.request("PROPFIND", "/health") as r:
        assert r.status == 405
    async with http.get("/metrics") as r:
        text = await r.text()
    # unusual methods share one label value: clients cannot grow the series without bound
    assert 'method="other"' in text and "PROPFIND" not in text


@pytest.mark.asyncio
async def test_unparseable_http_is_refused_without_a_traceback(server):
    # A method the HTTP parser does not know: aiohttp answers 400 itself; the server logs one
    # line (the fixture checks the log holds no traceback).
    r, w = await asyncio.open_connection("127.0.0.1", server.http_port)
    try:
        w.write(b"BREW /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status = await asyncio.wait_for(r.readline(), 10)
        assert b" 400 " in status, status
    finally:
        w.close()
        await w.wait_closed()


# ---------------------------------------------------------------- merged DECODE results
async def merged_decode(client: HydraClient, slot: int, n_predict: int, kv: bytes = b"", kv_metadata=None) -> dict:
    hdr = {"generation": {"n_predict": n_predict, "sampling": {"temperature": 0.7, "seed": 7}, "stop": [],
                          "stream": False}}
    if kv_metadata is not None:
        hdr["kv_metadata"] = kv_metadata
    r = await client.request(Op.DECODE, str(slot), encode_decode_v3(hdr, json.dumps(HELLO).encode(), kv))
    assert r.status == Status.OK and r.meta["valid"] is True, r
    return r.meta


async def poll_decode(http: aiohttp.ClientSession, decode_id: int, timeout: float = 60.0) -> dict:
    def finished(reply: tuple[int, dict]) -> bool:
        status, body = reply
        if status == 202:
            assert body["status"] == "running" and body["decode_request_id"] == decode_id
            return False
        assert status == 200, body
        return True

    _, body = await poll_until(lambda: get_json(http, f"/v1/decode/{decode_id}"), finished, timeout)
    return body


@pytest.mark.asyncio
async def test_merged_decode_with_kv_then_result_over_http(http, client):
    # A KV state from this server: generate on slot 1, STATE_GET it, restore it via DECODE into slot 3.
    async with http.post("/slots/1", params={"action": "erase"}) as r:
        assert r.status == 200
    async with http.post("/v1/completions", json={"prompt": "once upon", "max_tokens": 6, "slot": 1}) as r:
        assert r.status == 200
    blob = await client.request(Op.STATE_GET, b"1")
    assert blob.status == Status.OK
    n_past = blob.meta["n_past"]
    kv_md = {"n_past": n_past, "tokenizer": blob.meta["tokenizer"], "model_name": blob.meta["model_name"],
             "model_quant": blob.meta["model_quant"], "model_capabilities": 0}
    meta = await merged_decode(client, 3, 8, blob.payload, kv_md)
    assert meta["n_past_after_restore"] == n_past
    res = await poll_decode(http, meta["decode_request_id"])
    assert res["object"] == "chat.completion" and res["decode_request_id"] == meta["decode_request_id"]
    assert res["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(res["choices"][0]["message"]["content"], str)
    assert res["choices"][0]["finish_reason"] in ("stop", "length")
    assert res["stop_reason"] in ("eos", "length") and 0 < res["tokens_generated"] <= 8
    assert res["config_generation"] == 1 and res["status"] == "done"
    assert res["usage"]["completion_tokens"] == res["tokens_generated"]
    assert res["n_past_after_restore"] == n_past
    r = await client.request(Op.STATE_META, b"3")
    # the last sampled token is not in the KV yet (a continuation feeds it)
    assert res["n_past"] == r.meta["n_past"] and res["n_past"] > 0


@pytest.mark.asyncio
async def test_decode_running_202_interleaves_with_http_then_cancel(http, client):
    meta = await merged_decode(client, 0, 4000)
    did = meta["decode_request_id"]
    status, progress = await get_json(http, f"/v1/decode/{did}")
    assert status == 202 and progress["status"] == "running" and "tokens_generated" in progress
    # An HTTP completion on another slot runs in the same scheduler while the DECODE runs.
    async with http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4, "slot": 1}) as r:
        assert r.status == 200
    status, progress = await get_json(http, f"/v1/decode/{did}")
    assert status == 202, "the long DECODE should still be running"
    async with http.delete(f"/v1/decode/{did}") as r:
        assert r.status == 202 and (await r.json())["cancelled"] is True
    res = await poll_decode(http, did)
    assert res["status"] == "cancelled" and res["stop_reason"] == "cancelled"
    await wait_idle(http, 0)


@pytest.mark.asyncio
async def test_decode_result_404_when_unknown_or_evicted(http, client):
    status, body = await get_json(http, "/v1/decode/987654")
    assert status == 404
    assert_error_object(body, 404)
    first = (await merged_decode(client, 2, 1))["decode_request_id"]
    await poll_decode(http, first)
    for _ in range(DECODE_MAX):
        await poll_decode(http, (await merged_decode(client, 2, 1))["decode_request_id"])
    status, body = await get_json(http, f"/v1/decode/{first}")
    assert status == 404 and body["decode_request_id"] == first


# ---------------------------------------------------------------- metrics
def samples(text: str) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(snap: dict, name: str, **labels) -> float:
    return snap.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.asyncio
async def test_metrics_parse_and_count_requests_just_made(http, client):
    async with http.get("/metrics") as r:
        assert r.status == 200 and r.content_type == "text/plain"
        before = samples(await r.text())
    for _ in range(3):
        await get_json(http, "/health")
    for _ in range(2):
        assert (await client.request(Op.STATE_META, b"0")).ok
    async with http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}) as r:
        assert r.status == 200
        generated = (await r.json())["usage"]["completion_tokens"]
    async with http.get("/metrics") as r:
        after = samples(await r.text())

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("hydra_http_requests_total", route="/health", method="GET", code="200") == 3
    assert delta("hydra_requests_total", op="STATE_META", status="OK") == 2
    assert delta("hydra_request_duration_seconds_count", op="STATE_META") == 2
    assert delta("hydra_http_requests_total", route="/v1/completions", method="POST", code="200") == 1
    assert delta("hydra_tokens_generated_total") >= generated
    assert delta("hydra_http_generations_total", endpoint="completions", reason="length") \
        + delta("hydra_http_generations_total", endpoint="completions", reason="eos") == 1
    assert value(after, "hydra_slots", state="total") == 4
    assert value(after, "hydra_reload_state", state="idle") == 1
    assert value(after, "hydra_connections_open", port="engine") >= 1  # the client fixture's connection
    assert value(after, "hydra_connections_open", port="http") >= 1
    assert ("hydra_passthrough_bytes_total", (("direction", "up"),)) in after
    configured = value(after, "hydra_compute_threads", kind="configured")
    assert configured >= 1 and 1 <= value(after, "hydra_compute_threads", kind="current") <= configured
    assert value(after, "hydra_other_processes_cores") >= 0
    assert ("hydra_compute_threads_lowered_total", ()) in after
    assert ("hydra_compute_threads_reduced_seconds_total", ()) in after
    from tools.bench.openai_workload import compute_thread_counters

    counters = await compute_thread_counters(http, "")  # what the vs-llama-server bench reads of it
    assert set(counters) == {"reduced_s", "lowered"}  # counters: never below what the scrape above read
    assert counters["reduced_s"] >= value(after, "hydra_compute_threads_reduced_seconds_total")
    assert counters["lowered"] >= value(after, "hydra_compute_threads_lowered_total")
