"""OpenAI-compatible completions: the official ``openai`` client against a real server, streaming
and client disconnects, sampling fields, stop sequences; /health while the first model loads."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.model_params import ModelParams
from hydra_rpc.app import App
from hydra_rpc.config import ServerConfig
from hydra_rpc.http.app import start_http
from hydra_rpc.http.openai import StopFilter, cut_at_stop
from tests.helpers import start_server

HELLO = [{"role": "user", "content": "hello"}]


SERVER_ARGS = ("--model", "tiny", "--slots", "4", "--threads", "1", "--log-level", "WARNING")


@pytest_asyncio.fixture
async def openai_client(server):
    c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    yield c
    await c.close()


async def erase(http: aiohttp.ClientSession, slot: int) -> None:
    async with http.post(f"/slots/{slot}", params={"action": "erase"}) as r:
        assert r.status == 200, await r.text()


async def slot_meta(http: aiohttp.ClientSession, slot: int) -> dict:
    async with http.get(f"/slots/{slot}/state/meta") as r:
        return await r.json()


async def queued(http: aiohttp.ClientSession, slot: int) -> int:
    async with http.get("/slots") as r:
        return (await r.json())[slot]["queued"]


# ---------------------------------------------------------------- the openai package
@pytest.mark.asyncio
async def test_chat_completion_plain(openai_client):
    resp = await openai_client.chat.completions.create(model="hydra-tiny-a", messages=HELLO, max_tokens=8,
                                                temperature=0.8, top_p=0.9, seed=1)
    assert resp.object == "chat.completion" and resp.model == "hydra-tiny-a"
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 0 < resp.usage.completion_tokens <= 8 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


@pytest.mark.asyncio
async def test_chat_completion_streaming(openai_client):
    stream = await openai_client.chat.completions.create(model="whatever", messages=HELLO, max_tokens=12, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals in (["length"], ["stop"])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and 0 < usage.completion_tokens <= 12
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].model == "hydra-tiny-a"  # an unknown model name is served by the resident model
    assert isinstance(text, str)


@pytest.mark.asyncio
async def test_text_completion_plain_and_streaming(openai_client):
    resp = await openai_client.completions.create(model="hydra-tiny-a", prompt="once upon a time", max_tokens=6)
    assert resp.object == "text_completion" and isinstance(resp.choices[0].text, str)
    assert 0 < resp.usage.completion_tokens <= 6
    stream = await openai_client.completions.create(model="hydra-tiny-a", prompt="once", max_tokens=6, stream=True)
    chunks = [c async for c in stream]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # as llama-server: the last text-completion chunk carries the usage, asked for or not
    usage = chunks[-1].usage
    assert usage is not None and 0 < usage.completion_tokens <= 6 and usage.prompt_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.asyncio
async def test_same_seed_same_text(openai_client, http):
    async def run() -> str:
        await erase(http, 3)  # the same slot, empty: the same computation both times
        r = await openai_client.chat.completions.create(model="m", messages=HELLO, max_tokens=16, temperature=1.0,
                                                 seed=1234, extra_body={"slot": 3})
        return r.choices[0].message.content

    assert await run() == await run()


@pytest.mark.asyncio
async def test_stop_sequence_cuts_the_text(openai_client, http):
    async def run(**kw) -> tuple[str, str]:
        await erase(http, 3)
        r = await openai_client.chat.completions.create(model="m", messages=HELLO, max_tokens=40, temperature=0,
                                                 extra_body={"slot": 3}, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason

    full, _ = await run()
    # a two-character ASCII stop that first occurs after a few characters of the greedy text
    at = next((i for i in range(3, len(full) - 1) if full[i:i + 2].isascii() and full[i:i + 2].isprintable()
               and full.find(full[i:i + 2]) == i), None)
    if at is None:
        pytest.skip(f"no usable stop string in {full!r}")
    text, finish = await run(stop=[full[at:at + 2]])
    assert (text, finish) == (full[:at], "stop")
    chunks = [c async for c in await openai_client.chat.completions.create(
        model="m", messages=HELLO, max_tokens=40, temperature=0, stop=[full[at:at + 2]], stream=True,
        extra_body={"slot": 3})]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[:at]
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.asyncio
async def test_openai_errors_are_raised_as_api_errors(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        await openai_client.chat.completions.create(model="m", messages=[], max_tokens=4)
    assert "messages" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        await openai_client.chat.completions.create(model="m", messages=HELLO, max_tokens=4, extra_body={"slot": 42})


# ---------------------------------------------------------------- disconnects
def metric(text: str, name: str, **labels) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


@pytest.mark.asyncio
async def test_sse_client_disconnect_cancels_generation_and_frees_slot(http):
    await erase(http, 1)
    async with http.get("/metrics") as r:
        cancelled_before = metric(await r.text(), "hydra_http_generations_total", endpoint="chat", reason="cancelled")
    # greedy: the tiny model never samples EOS so, and the stream is still running when META is read
    body = {"messages": HELLO, "max_tokens": 4000, "stream": True, "slot": 1, "temperature": 0}
    async with http.post("/v1/chat/completions", json=body) as stream:
        assert stream.status == 200 and stream.headers["Content-Type"].startswith("text/event-stream")
        assert (await stream.content.readline()).startswith(b"data: ")
        assert (await slot_meta(http, 1))["is_processing"] is True
        stream.close()  # drop the connection mid-stream
    async with asyncio.timeout(30):
        while (meta := await slot_meta(http, 1))["is_processing"]:
            await asyncio.sleep(0.02)
    assert meta["n_past"] < 4000  # stopped long before max_tokens
    async with http.get("/metrics") as r:
        text = await r.text()
    assert metric(text, "hydra_http_generations_total", endpoint="chat", reason="cancelled") == cancelled_before + 1


@pytest.mark.asyncio
async def test_disconnect_while_queued_behind_a_busy_slot_cancels_the_waiting_job(http):
    await erase(http, 2)
    body = {"messages": HELLO, "max_tokens": 4000, "stream": True, "slot": 2, "temperature": 0}
    async with http.post("/v1/chat/completions", json=body) as first:
        assert first.status == 200
        # A non-streamed request for the same slot waits in its queue; then its client gives up.
        waiting = asyncio.create_task(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "slot": 2}))
        async with asyncio.timeout(10):
            while await queued(http, 2) != 1:
                await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        async with asyncio.timeout(10):
            while await queued(http, 2) != 0:
                await asyncio.sleep(0.01)
        # the first one was not cancelled with it: it runs to its own end (a cancelled stream's
        # last chunk has no finish_reason), however fast the host made it
        async with asyncio.timeout(30):
            events = [json.loads(line[len("data: "):]) for line in (await first.read()).decode().splitlines()
                      if line.startswith("data: {")]
        reasons = [e["choices"][0].get("finish_reason") for e in events if e.get("choices")]
        assert len(reasons) > 1 and reasons[-1] in ("stop", "length"), events[-2:]
    async with asyncio.timeout(30):
        while (await slot_meta(http, 2))["is_processing"]:
            await asyncio.sleep(0.02)


# ---------------------------------------------------------------- stop-sequence helpers
def test_cut_at_stop_takes_the_earliest_stop():
    assert cut_at_stop("hello world", ["wor", "lo"]) == ("hel", True)
    assert cut_at_stop("hello", ["xyz"]) == ("hello", False)


@pytest.mark.parametrize("pieces, stops, sent, hit", [
    (["hel", "lo w", "orld"], ["o w"], "hell", True),
    (["ab", "c", "d"], ["cd"], "ab", True),  # a stop split across pieces is never sent
    (["ab", "cx"], ["cd"], "abcx", False),  # held-back "c" is released once it cannot start the stop
    (["abc"], ["cde"], "abc", False),  # flushed at the end
    (["a", "b"], [], "ab", False),
])
def test_stop_filter_streams_exactly_the_text_before_the_stop(pieces, stops, sent, hit):
    f = StopFilter(stops)
    out = "".join(f.feed(p) for p in pieces) + f.flush()
    assert (out, f.hit) == (sent, hit)


# ---------------------------------------------------------------- startup
@pytest.mark.asyncio
async def test_health_is_503_while_the_first_model_loads_then_200(tiny_model_path):
    app = App(ServerConfig(host="127.0.0.1", port=0),
              EngineConfig(model=ModelParams(tiny_model_path, n_ctx=512, n_slots=2, n_threads=1)))
    http = await start_http(app.services, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{http.address[1]}") as s:
            async with s.get("/health") as r:
                body = await r.json()
                assert r.status == 503 and body["status"] == "loading" and body["has_model"] is False
                assert body["startup_stage"] == "init" and body["rpc_active"] is False
            async with s.post("/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 503 and "startup stage" in (await r.json())["error"]["message"]
            async with s.get("/slots") as r:  # a node agent's health probe: not yet
                assert r.status == 503 and r.headers["Retry-After"] == "1"
            await app.engine.start()
            async with s.get("/health") as r:
                body = await r.json()
                assert r.status == 200 and body["status"] == "ok" and body["model_name"] == "hydra-tiny-a"
            async with s.get("/slots") as r:
                assert [e["id"] for e in await r.json()] == [0, 1]
    finally:
        await http.cleanup()
        await app.engine.stop()


@pytest.mark.asyncio
async def test_health_reports_a_failed_first_load(tmp_path):
    app = App(ServerConfig(host="127.0.0.1", port=0),
              EngineConfig(model=ModelParams(str(tmp_path / "missing.gguf"), n_ctx=256, n_slots=1)))
    http = await start_http(app.services, "127.0.0.1", 0)
    try:
        with pytest.raises(Exception):
            await app.engine.start()
        async with aiohttp.ClientSession(f"http://127.0.0.1:{http.address[1]}") as s:
            async with s.get("/health") as r:
                body = await r.json()
                assert r.status == 503 and body["status"] == "error" and body["startup_stage"] == "failed"
                assert body["error"]
    finally:
        await http.cleanup()
        await app.engine.stop()


# ---------------------------------------------------------------- model swap by name
@pytest.mark.asyncio
async def test_model_alias_swaps_the_model_and_metrics_show_the_reload(tiny_model_b_path):
    sp = start_server("--model", "tiny", "--model-alias", "other=tiny-b", "--slots", "2", "--threads", "1",
                      "--log-level", "WARNING")
    try:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{sp.http_port}/v1", api_key="unused",
                                      max_retries=0, timeout=60) as client:
            models = await client.models.list()
            assert [(m.id, m.model_extra["resident"]) for m in models.data] == [("hydra-tiny-a", True),
                                                                                ("other", False)]
            resp = await client.chat.completions.create(model="other", messages=HELLO, max_tokens=4)
            assert resp.model == "other" and resp.system_fingerprint == "hydra-rpc-g2"
        async with aiohttp.ClientSession(f"http://127.0.0.1:{sp.http_port}") as s:
            async with s.get("/health") as r:
                h = await r.json()
                assert h["model_name"] == "hydra-tiny-b" and h["config_generation"] == 2
            async with s.get("/metrics") as r:
                text = await r.text()
        assert metric(text, "hydra_reload_state", state="swapped") == 1
        assert metric(text, "hydra_reload_last_load_seconds") > 0
        assert metric(text, "hydra_config_generation") == 2
    finally:
        assert sp.stop() == 0, sp.log
