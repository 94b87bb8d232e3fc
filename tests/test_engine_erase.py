"""Erase of a busy slot, step by step on the scripted backend: deferred until the slot's job
ends (answered then, before the jobs queued for the slot), bounded in number and in time."""
from __future__ import annotations

import asyncio

import pytest

from engine.jobs import EngineBusy, GenJob
from tests.engine_env import long_generation, scripted_engine
from tests.scripted_backend import until

pytestmark = pytest.mark.timeout(60)


async def deferred_erase(eng, slot: int, n: int = 1) -> asyncio.Task:
    task = asyncio.create_task(eng.erase(slot))
    await until(lambda: len(eng.slots[slot].erase_waiters) == n, "the erase waiting")
    return task


@pytest.mark.asyncio
async def test_erase_of_a_busy_slot_is_done_when_its_job_ends_before_the_queued_job():
    async with scripted_engine(n_ctx_slot=4096) as env:
        eng = env.engine
        running = await long_generation(eng, 0)
        erase = await deferred_erase(eng, 0)
        queued = eng.submit(GenJob(0, prompt="xyz", n_predict=2))
        await until(lambda: eng.snapshot(0).queued == 1, "the next job queued")
        assert not erase.done() and eng.snapshot(0).is_processing
        running.cancel()
        res = await running.result()
        assert await erase == res.n_past > 0  # the tokens the slot held when its job ended
        assert (await queued.result()).cached_tokens == 0  # it ran after the erase, on an empty slot
        assert eng.snapshot(0).n_past == len(env.model.kv[0]) > 0


@pytest.mark.asyncio
async def test_erase_bounds_how_many_wait_and_how_long():
    async with scripted_engine(n_ctx_slot=4096) as env:  # slot_queue 2: two erases may wait per slot
        eng = env.engine
        running = await long_generation(eng, 0)
        waiting = [await deferred_erase(eng, 0, 1), await deferred_erase(eng, 0, 2)]
        with pytest.raises(EngineBusy, match="erase"):
            await eng.erase(0)
        queued = eng.submit(GenJob(0, prompt="busy", n_predict=1))
        await until(lambda: eng.snapshot(0).queued == 1, "a job queued behind the erases")
        assert env.timers.fire() >= 2  # their time is up while the slot still works
        for task in waiting:
            with pytest.raises(EngineBusy, match="stayed busy"):
                await task
        running.cancel()
        await running.result()
        # nothing was erased: the queued job reuses what the slot held
        assert (await queued.result()).cached_tokens > 0


@pytest.mark.asyncio
async def test_erase_of_an_idle_slot_is_immediate_and_a_waiter_that_leaves_frees_the_queue():
    async with scripted_engine(n_ctx_slot=4096) as env:
        eng = env.engine
        await eng.submit(GenJob(1, prompt="abc", n_predict=1)).result()
        assert await eng.erase(1) > 0 and eng.snapshot(1).n_past == 0
        running = await long_generation(eng, 0)
        erase = await deferred_erase(eng, 0)
        with pytest.raises(EngineBusy):  # a job that may not wait is refused, as for a busy slot
            await eng.submit(GenJob(0, prompt="q", n_predict=1, wait=False)).result()
        erase.cancel()  # the client left
        await until(lambda: all(f.done() for f in eng.slots[0].erase_waiters), "the waiter gone")
        running.cancel()
        await running.result()
        assert eng.snapshot(0).n_past > 0  # not erased
