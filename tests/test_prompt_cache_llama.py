"""The prompt cache on the real model (tiny llama GGUF): a system prompt shared across slots,
the RAM tier, reloads, slot files over HTTP, the wire and OpenAI reports of cached tokens,
and a burst of chats spreading over every slot. Every "same continuation" is checked
against an engine that computed the whole prompt itself."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from codec import payloads as P
from codec.enums import Op
from engine.api import EngineApi
from engine.config import EngineConfig
from engine.jobs import GenRequest, GenResult
from engine.model_params import ModelParams
from engine.sampling import GREEDY
from hydra_rpc.client import HydraClient
from tests.helpers import start_server

# about 560 tokens with the tiny model's vocabulary
SYSTEM = " ".join(f"rule {i}: answer briefly and precisely." for i in range(22))


@contextlib.asynccontextmanager
async def real_engine(path: str, n_slots: int = 2, cache_prompt: bool = True, n_batch: int = 512, **cfg):
    # one KV pool of 1024 cells that each slot may fill (llama-server's unified KV)
    eng = EngineApi(EngineConfig(model=ModelParams(path, n_ctx=1024, n_slots=n_slots, n_threads=1, n_batch=n_batch,
                                                cache_prompt=cache_prompt), low_priority=False, **cfg))
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


async def run(eng: EngineApi, request: GenRequest) -> GenResult:
    return await eng.submit(request).result()


def prefill(slot: int, prompt: str) -> GenRequest:
    return GenRequest(slot, prompt=prompt, n_predict=0, capture_state=True)  # what a Hydra PREFILL runs


def cont(slot: int, n: int = 24) -> GenRequest:
    return GenRequest(slot, n_predict=n, sampling=GREEDY)  # a greedy DECODE continuing the slot


@pytest.mark.asyncio
async def test_second_slot_reuses_the_first_slots_system_prompt(tiny_model_path):
    async with real_engine(tiny_model_path) as eng:
        assert len(eng.actor.model.tokenize(SYSTEM)) >= 500
        await run(eng, prefill(0, SYSTEM + " Ann asks: why?"))
        second = await run(eng, prefill(1, SYSTEM + " Bob asks: how?"))
        cached = await run(eng, cont(1))
        assert second.cached_tokens >= 500 and eng.actor.cache.stats.from_shared == 1
    async with real_engine(tiny_model_path, cache_prompt=False) as eng:
        alone = await run(eng, prefill(1, SYSTEM + " Bob asks: how?"))
        uncached = await run(eng, cont(1))
        assert alone.cached_tokens == 0
    assert cached.generated == uncached.generated and len(cached.generated) == 24


@pytest.mark.asyncio
async def test_a_conversation_evicted_from_its_slot_comes_back_from_the_ram_tier(tiny_model_path):
    turn2 = " Ann asks: and then?"
    async with real_engine(tiny_model_path, n_slots=1) as eng:
        await run(eng, prefill(0, SYSTEM + " Ann asks: why?"))
        first = await run(eng, cont(0, 8))
        history = first.tokens + first.generated[-1:]  # what Ann's next turn starts with
        await run(eng, prefill(0, "A different conversation takes the only slot."))
        assert eng.actor.cache.info().ram_entries == 1
        back = await run(eng, GenRequest(0, tokens=history + eng.actor.model.tokenize(turn2, add_special=False),
                                     n_predict=16, sampling=GREEDY))
        assert back.cached_tokens == len(first.tokens) and eng.actor.cache.info().ram_restores == 1
    async with real_engine(tiny_model_path, n_slots=1, cache_ram_mib=0) as eng:
        await run(eng, prefill(0, SYSTEM + " Ann asks: why?"))
        await run(eng, cont(0, 8))
        await run(eng, prefill(0, "A different conversation takes the only slot."))
        cold = await run(eng, GenRequest(0, tokens=history + eng.actor.model.tokenize(turn2, add_special=False),
                                     n_predict=16, sampling=GREEDY))
        assert cold.cached_tokens <= 1
    assert back.generated == cold.generated


@pytest.mark.asyncio
async def test_a_ram_tier_entry_is_never_used_after_a_reload(tiny_model_path):
    async with real_engine(tiny_model_path, n_slots=1) as eng:
        await run(eng, prefill(0, SYSTEM + " Ann asks: why?"))
        await run(eng, prefill(0, "A different conversation takes the only slot."))
        assert eng.actor.cache.info().ram_entries == 1
        out = await eng.configure({"n_ctx": 1024 + 256})  # a T3 reload: a new context
        await eng.wait_reload(out.reload_ticket)
        info = eng.actor.cache.info()
        assert info.ram_entries == 0 and info.ram_invalidated == 1 and info.ram_bytes == 0
        back = await run(eng, prefill(0, SYSTEM + " Ann asks: why?"))
        assert back.cached_tokens == 0 and eng.actor.cache.info().ram_restores == 0


@pytest.mark.asyncio
async def test_a_ram_tier_state_is_checked_as_a_state_put_is(tiny_model_path, monkeypatch, caplog):
    async with real_engine(tiny_model_path, n_slots=1) as eng:
        await run(eng, prefill(0, SYSTEM + " Ann asks: why?"))
        await run(eng, prefill(0, "A different conversation takes the only slot."))
        (entry,) = eng.actor.cache.host.entries.values()
        state = bytearray(entry.state)  # magic, seq_id, n_stream, cell_count, then the cells
        cells, words = struct.unpack_from("<I", state, 12)[0], 6 if eng.kv_cache.layout.cell_ext else 3
        struct.pack_into("<i", state, 16 + 4 * words * (cells - 1), 1 << 26)  # the last cell's position
        entry.state = bytes(state)
        seen: list[int] = []
        set_state = eng.actor.model.state_seq_set
        monkeypatch.setattr(eng.actor.model, "state_seq_set", lambda seq, data: seen.append(seq) or set_state(seq, data))
        back = await run(eng, prefill(0, SYSTEM + " Ann asks: why?"))
        assert seen == [] and back.cached_tokens == 0  # refused before llama.cpp saw it; computed instead
        assert "positions 0..67108864 outside" in caplog.text


# ---------------------------------------------------------------- through the server
@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def cache_server(tiny_model_path, slot_dir):
    sp = start_server("--model", "tiny", "--parallel", "4", "--kv-unified", "--kv-unified-per-slot", "1024",
                      "--slot-queue", "10", "--threads", "1", "--log-level", "WARNING",
                      "--slot-save-path", str(slot_dir))
    yield sp
    assert sp.stop() == 0, sp.log


@pytest_asyncio.fixture
async def http(cache_server):
    async with aiohttp.ClientSession(f"http://127.0.0.1:{cache_server.http_port}") as s:
        yield s


async def completion(http: aiohttp.ClientSession, prompt: str, max_tokens: int, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    async with http.post("/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def slot_action(http: aiohttp.ClientSession, slot: int, action: str, filename=None) -> tuple[int, dict]:
    body = None if filename is None else {"filename": filename}
    async with http.post(f"/slots/{slot}", params={"action": action}, json=body) as r:
        return r.status, await r.json()


@pytest.mark.asyncio
async def test_prefill_meta_and_openai_usage_report_cached_tokens(cache_server, http):
    c = await HydraClient.connect(cache_server.host, cache_server.port)
    try:
        r0 = await c.request(Op.PREFILL, "2", json.dumps({"prompt": SYSTEM + " Ann asks: why?"}).encode())
        r1 = await c.request(Op.PREFILL, "3", json.dumps({"prompt": SYSTEM + " Bob asks: how?"}).encode())
        d = await c.request(Op.DECODE, "2", P.encode_e1_decode(2, [5, 6, 7]))  # E1: appends 3 tokens
    finally:
        await c.close()
    assert r0.meta["cache_tokens"] == 0
    m = r1.meta
    assert m["cache_tokens"] >= 500 and m["tokens_processed"] == m["prompt_tokens"] - m["cache_tokens"]
    assert d.meta["cache_tokens"] == r0.meta["n_past"] and d.meta["tokens_processed"] == 3
    again = await completion(http, SYSTEM + " Bob asks: how?", 4, id_slot=3)
    usage, timings = again["usage"], again["timings"]
    # all of it: the PREFILL left its last token's logits with the slot, so nothing is decoded again
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    assert timings["cache_n"] == usage["prompt_tokens"] and timings["prompt_n"] == 0
    assert again["id_slot"] == 3
    async with http.get("/metrics") as r:
        families = {f.name: f for f in text_string_to_metric_families(await r.text())}
    hits = {s.labels["source"]: s.value for s in families["hydra_prompt_cache_hits"].samples
            if s.name.endswith("_total")}
    assert hits["shared"] >= 1 and hits["own"] >= 1
    tokens_saved = families["hydra_prompt_cache_tokens_saved"].samples[0].value
    assert tokens_saved >= m["cache_tokens"] + usage["prompt_tokens"]


@pytest.mark.asyncio
async def test_save_erase_restore_gives_the_same_continuation(http, slot_dir):
    prompt = SYSTEM + " Cat asks: where?"
    first = await completion(http, prompt, 0, id_slot=1)  # fills slot 1
    status, saved = await slot_action(http, 1, "save", "cat.bin")
    assert status == 200, saved
    n = first["usage"]["prompt_tokens"]
    assert set(saved) == {"id_slot", "filename", "n_saved", "n_written", "timings"}
    assert saved["id_slot"] == 1 and saved["filename"] == "cat.bin" and saved["n_saved"] == n
    assert saved["n_written"] == os.path.getsize(slot_dir / "cat.bin") and "save_ms" in saved["timings"]
    reference = await completion(http, prompt, 16, id_slot=1)
    status, erased = await slot_action(http, 1, "erase")
    assert status == 200 and erased["id_slot"] == 1
    status, restored = await slot_action(http, 1, "restore", "cat.bin")
    assert status == 200, restored
    assert set(restored) == {"id_slot", "filename", "n_restored", "n_read", "timings"}
    assert restored["n_restored"] == n and restored["n_read"] == saved["n_written"]
    again = await completion(http, prompt, 16, id_slot=1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert again["choices"][0]["text"] == reference["choices"][0]["text"]


@pytest.mark.asyncio
async def test_slot_file_names_stay_inside_the_directory(http, slot_dir, tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not for clients")
    (slot_dir / "link.bin").symlink_to(outside)
    for bad in ("../escape.bin", "/etc/passwd", "a/b.bin", "..", ".", "", " lead", "trail.", "nul\x00.bin",
                "c:\\x", "link.bin", "x" * 256):
        for action in ("save", "restore"):
            status, body = await slot_action(http, 0, action, bad)
            assert status == 400, (bad, action, body)
            assert "filename" in body["error"]["message"]
    status, body = await slot_action(http, 0, "restore", 42)
    assert status == 400
    status, body = await slot_action(http, 0, "restore", "missing.bin")
    assert status == 400 and "no slot file" in body["error"]["message"]
    (slot_dir / "garbage.bin").write_bytes(b"\x00" * 64)
    status, body = await slot_action(http, 0, "restore", "garbage.bin")
    assert status == 400 and "not a llama.cpp sequence state file" in body["error"]["message"]
    private = next(p.name for p in slot_dir.iterdir() if p.name.startswith(".hydra-prompt-cache-"))
    for action in ("save", "restore"):  # the RAM tier's spill directory is not a slot file
        status, body = await slot_action(http, 0, action, private)
        assert status == 400 and "not a file" in body["error"]["message"]
    assert outside.read_bytes() == b"not for clients"
    assert [p.name for p in slot_dir.iterdir() if p.name.startswith(".slot-")] == []  # no temp files left


@pytest.mark.asyncio
async def test_slot_files_need_a_directory(tiny_model_path):
    from hydra_rpc.app import App
    from hydra_rpc.config import ServerConfig
    from hydra_rpc.http.app import start_http

    app = App(ServerConfig(host="127.0.0.1", port=0),
              EngineConfig(model=ModelParams(tiny_model_path, n_ctx=256, n_slots=1, n_threads=1)))
    side = await start_http(app.services, "127.0.0.1", 0)
    await app.engine.start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{side.address[1]}") as s:
            status, body = await slot_action(s, 0, "save", "a.bin")
            assert status == 501 and body["error"]["type"] == "not_supported_error"
            assert "--slot-save-path" in body["error"]["message"]
            status, _ = await slot_action(s, 0, "erase")
            assert status == 200  # erase needs no directory
    finally:
        await side.cleanup()
        await app.engine.stop()


@pytest.mark.asyncio
async def test_a_burst_of_chats_spreads_over_every_slot(http):
    async def chat(i: int) -> tuple[int, dict]:
        body = {"messages": [{"role": "user", "content": f"question number {i}"}], "max_tokens": 4}
        async with http.post("/v1/chat/completions", json=body) as r:
            return r.status, await r.json()

    replies = await asyncio.gather(*(chat(i) for i in range(40)))
    assert [status for status, _ in replies] == [200] * 40, [b for s, b in replies if s != 200][:2]
    assert {body["id_slot"] for _, body in replies} == {0, 1, 2, 3}
