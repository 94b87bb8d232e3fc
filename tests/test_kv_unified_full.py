"""A unified KV cache the slots fill together (``--kv-unified``: every slot may grow to the whole
context, so two can want more cells than there are). llama-server's answer, and ours:

* a batch that finds no free cell first takes the cells of the slots no job runs on (their
  cached prompts; ``try_clear_idle_slots``) and is decoded again;
* when the running jobs alone fill the cache, each of them fails with "Context size has been
  exceeded" — an ERROR / HTTP 500 without a traceback — and the engine goes on serving.

Step by step on the scripted backend (a cache of ``kv_cells``), then on a real tiny model.
"""
from __future__ import annotations

import aiohttp
import pytest

from engine.jobs import GenRequest, KvCacheFull
from tests.engine_env import scripted_engine
from tests.helpers import serving


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_an_idle_slots_cached_prompt_gives_way_to_a_running_batch():
    async with scripted_engine(n_ctx_slot=128) as env:
        first = await env.engine.submit(GenRequest(0, prompt="a" * 60, n_predict=1)).result()
        assert first.tokens_generated == 1 and len(env.model.kv[0]) > 60  # slot 0 keeps its prompt
        env.model.kv_cells = 100  # room for one of the two prompts, not both
        second = await env.engine.submit(GenRequest(1, prompt="b" * 60, n_predict=2)).result()
        assert second.tokens_generated == 2
        assert env.model.kv[0] == [] and env.actor.slots[0].tokens == []  # given up, and the slot knows it
        assert env.engine.snapshot(0).n_past == 0


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_running_jobs_that_fill_the_cache_together_fail_and_the_engine_serves_on():
    async with scripted_engine(n_ctx_slot=128) as env:
        env.model.kv_cells = 100
        gate = env.factory.decode_gate
        gate.close()
        one = env.engine.submit(GenRequest(0, prompt="a" * 60, n_predict=20))
        await gate.wait_held(1, "slot 0's prompt")
        two = env.engine.submit(GenRequest(1, prompt="b" * 60, n_predict=20))
        gate.open()
        for job in (one, two):  # slot 0 was running when slot 1's prompt found no room: nothing to free
            with pytest.raises(KvCacheFull):
                await job.result()
        again = await env.engine.submit(GenRequest(0, prompt="c" * 10, n_predict=3)).result()
        assert again.tokens_generated == 3


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_real_unified_cache_gives_an_idle_slots_cells_to_the_next_prompt():
    """tiny, ``--kv-unified --ctx-size 512`` with two slots: 300 prompt tokens on slot 0, then
    300 on slot 1, fit once slot 0's cache is given up (it failed before, 500 and a traceback
    on the Hydra port)."""
    with serving("--model", "tiny", "--parallel", "2", "--kv-unified", "--ctx-size", "512",
                 "--threads", "1") as sp:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{sp.http_port}") as http:
            async def completion(slot: int, tokens: list[int], n: int) -> tuple[int, dict]:
                body = {"prompt": tokens, "n_predict": n, "id_slot": slot, "temperature": 0}
                async with http.post("/completion", json=body) as r:
                    return r.status, await r.json()

            status, _ = await completion(0, list(range(10, 310)), 1)
            assert status == 200
            status, body = await completion(1, list(range(20, 320)), 2)
            assert status == 200 and body["tokens_predicted"] == 2, body
            async with http.get("/slots") as r:
                slots = {s["id"]: s for s in await r.json()}
            assert slots[0]["n_past"] == 0 and slots[1]["n_past"] >= 300, slots
        assert "idle slot 0 gives up its" in sp.log and "Traceback" not in sp.log, sp.log[-3000:]
