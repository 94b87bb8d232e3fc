"""llama-server's own endpoints and its deferral rule, against a real server: /completion
(streamed and not), /props, /tokenize, /detokenize, /apply-template; a full slot queue answers
503 with Retry-After after deferring up to --slot-queue; PREFILL "model": null."""
from __future__ import annotations

import asyncio
import json

import pytest

from codec.enums import Op
from tests.helpers import long_chat, poll_until, slot_meta_http

SERVER_ARGS = ("--model", "tiny", "--parallel", "2", "--slot-queue", "1", "--threads", "1",
               "--log-level", "WARNING")
pytestmark = pytest.mark.timeout(120)
PROMPT = "The capital of France is"


async def post(http, path: str, body: dict) -> tuple[int, dict]:
    async with http.post(path, json=body) as r:
        return r.status, await r.json()


@pytest.mark.asyncio
async def test_tokenize_detokenize_round_trip(http):
    status, tok = await post(http, "/tokenize", {"content": PROMPT})
    assert status == 200 and tok["tokens"] and all(isinstance(t, int) for t in tok["tokens"])
    status, with_bos = await post(http, "/tokenize", {"content": PROMPT, "add_special": True})
    assert len(with_bos["tokens"]) >= len(tok["tokens"])
    status, pieces = await post(http, "/tokenize", {"content": PROMPT, "with_pieces": True})
    assert [p["id"] for p in pieces["tokens"]] == tok["tokens"]
    assert "".join(p["piece"] for p in pieces["tokens"] if isinstance(p["piece"], str)) == PROMPT
    status, detok = await post(http, "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["content"] == PROMPT
    assert (await post(http, "/tokenize", {"content": 5}))[0] == 400
    status, err = await post(http, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and err["error"]["param"] == "tokens"


@pytest.mark.asyncio
async def test_apply_template_renders_without_inference(http):
    status, out = await post(http, "/apply-template", {"messages": [{"role": "user", "content": "hello"}]})
    assert status == 200 and "hello" in out["prompt"]
    assert (await post(http, "/apply-template", {"messages": "hello"}))[0] == 400


@pytest.mark.asyncio
async def test_props(http):
    async with http.get("/props") as r:
        assert r.status == 200
        props = await r.json()
    assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] > 0
    assert {"temperature", "top_k", "n_predict"} <= props["default_generation_settings"]["params"].keys()
    assert props["model_path"].endswith(".gguf") and props["modalities"]["vision"] is False
    assert props["devices"] and "n_gpu_layers" in props
    assert (await post(http, "/props", {}))[0] == 501


@pytest.mark.asyncio
async def test_completion_whole_and_streamed_agree(http):
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "return_tokens": True, "id_slot": 1}
    status, whole = await post(http, "/completion", body)
    assert status == 200, whole
    assert whole["stop"] is True and whole["id_slot"] == 1 and whole["tokens_predicted"] == 6
    assert whole["stop_type"] == "limit" and len(whole["tokens"]) == 6 and whole["tokens_evaluated"] > 0
    assert whole["generation_settings"]["n_predict"] == 6 and whole["timings"]["predicted_n"] == 6
    async with http.post("/completion", json={**body, "stream": True}) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: ")]
    assert [e["stop"] for e in events] == [False] * 6 + [True]  # and no [DONE], as llama-server
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [e["tokens"][0] for e in events[:-1]] == whole["tokens"]
    assert events[-1]["tokens_cached"] > 0  # the same prompt on the same slot
    status, err = await post(http, "/completion", {"prompt": 3})
    assert status == 400 and err["error"]["param"] == "prompt"


@pytest.mark.asyncio
async def test_full_queue_defers_then_answers_503_with_retry_after(http):
    async with long_chat(http, 0):
        # --slot-queue 1: the next request for slot 0 waits (deferred, as llama-server does) …
        waiting = asyncio.create_task(post(http, "/completion", {"prompt": "x", "n_predict": 1, "id_slot": 0}))
        await poll_until(lambda: slot_meta_http(http, 0), lambda m: m["queue_position"] == 1)
        # … and one more finds the queue full: 503, come back later
        async with http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "slot": 0}) as r:
            err = await r.json()
            assert r.status == 503 and r.headers["Retry-After"] == "1", err
            assert err["error"]["type"] == "unavailable_error" and err["retry_after_ms"] > 0
        assert not waiting.done()
    status, done = await waiting
    assert status == 200 and done["tokens_predicted"] == 1


@pytest.mark.asyncio
async def test_prefill_model_null_means_the_loaded_model(client):
    body = {"model": None, "hydra_config": None, "messages": [{"role": "user", "content": "hi"}]}
    r = await client.request(Op.PREFILL, b"1", json.dumps(body).encode())
    assert r.ok and r.meta["model_fallback"] is False and r.meta["n_past"] > 0, r.meta
