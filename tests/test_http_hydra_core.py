"""The HTTP port as Hydra Core calls it (docs/http.md): ``GET /slots`` as its health poll and
stuck-slot counter read it, ``model_hash`` for its cross-model guard, ``/models/load``,
HTTP state transfer and chat completions with ``id_slot``, ``stream_options`` and
``n_predict: 0``. A real server with the tiny model; plain aiohttp as the client."""
from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

HELLO = [{"role": "user", "content": "hello"}]
LONG = {"messages": HELLO, "max_tokens": 4000, "temperature": 0}  # greedy: runs its full length

SERVER_ARGS = ("--model", "tiny", "--slots", "4", "--threads", "1", "--no-low-priority", "--log-level", "WARNING")


async def get_json(http: aiohttp.ClientSession, path: str):
    async with http.get(path) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def slot_entry(http: aiohttp.ClientSession, slot: int) -> dict:
    slots = await get_json(http, "/slots")
    assert isinstance(slots, list)  # Hydra Core's warm check needs a top-level array
    return next(s for s in slots if s["id"] == slot)


async def poll_slots(http: aiohttp.ClientSession, slot: int, pred, timeout: float = 60.0) -> dict:
    async with asyncio.timeout(timeout):
        while True:
            s = await slot_entry(http, slot)
            if pred(s):
                return s
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def generating(http: aiohttp.ClientSession, slot: int, body: dict | None = None):
    """A long streamed chat on ``slot`` (read by a background task) until the block ends."""
    async def consume() -> None:
        async with http.post("/v1/chat/completions", json={**(body or LONG), "slot": slot, "stream": True}) as r:
            assert r.status == 200
            async for _ in r.content:
                pass

    task = asyncio.create_task(consume())
    try:
        await poll_slots(http, slot, lambda s: s["is_processing"] and s["n_decoded"] > 0)
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await poll_slots(http, slot, lambda s: not s["is_processing"])


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
    async with generating(http, 0):
        first = await slot_entry(http, 0)
        second = await poll_slots(http, 0, lambda s: s["n_remain"] < first["n_remain"])
    for s in (first, second):
        assert s["is_processing"] and s["n_remain"] > 0  # never 0 while busy: not counted as stuck
        assert s["next_token"][0]["n_remain"] == s["n_remain"] and s["next_token"][0]["has_next_token"]
        assert s["id_task"] >= 0 and s["params"]["n_predict"] == 4000 and s["params"]["temperature"] == 0
    assert second["n_decoded"] > first["n_decoded"]
    done = await slot_entry(http, 0)
    assert not done["is_processing"] and done["n_remain"] == 0 and done["id_task"] == -1
