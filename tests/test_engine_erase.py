"""Erase of a busy slot, step by step on the scripted backend: deferred until the slot's job
ends (answered then, before the jobs queued for the slot), bounded in number and in time.
The engine runs in step mode: the actor takes the erases and jobs a test sends between two
steps, when the test lets the step in flight end (tests/engine_env.py)."""
from __future__ import annotations

import asyncio

import pytest

from engine.jobs import EngineBusy, GenRequest
from tests.engine_env import scripted_engine

pytestmark = pytest.mark.timeout(60)


async def send(call) -> asyncio.Task:
    """Start a mailbox call: its task's first turn posts the message, which the actor takes
    after the step in flight."""
    task = asyncio.ensure_future(call)
    await asyncio.sleep(0)
    return task


def erases_waiting(env, slot: int) -> int:
    return len(env.actor.slots[slot].erase_waiters)


@pytest.mark.asyncio
async def test_erase_of_a_busy_slot_is_done_when_its_job_ends_before_the_queued_job():
    async with scripted_engine(n_ctx_slot=4096, stepped=True) as env:
        eng = env.engine
        running = await env.long_generation(0)
        erase = await send(eng.erase(0))
        queued = eng.submit(GenRequest(0, prompt="xyz", n_predict=2))
        await env.step()  # then the actor takes both: the erase waits, the job queues
        assert erases_waiting(env, 0) == 1 and eng.snapshot(0).queued == 1
        assert not erase.done() and eng.snapshot(0).is_processing
        running.cancel()
        await env.step()  # the job ends with the step in flight; the erase is done before the next
        res = await running.result()
        assert await erase == res.n_past > 0  # the tokens the slot held when its job ended
        assert (await env.finish(queued)).cached_tokens == 0  # it ran after the erase, on an empty slot
        assert eng.snapshot(0).n_past == len(env.model.kv[0]) > 0


@pytest.mark.asyncio
async def test_erase_bounds_how_many_wait_and_how_long():
    async with scripted_engine(n_ctx_slot=4096, stepped=True) as env:  # slot_queue 2: two erases may wait
        eng = env.engine
        running = await env.long_generation(0)
        waiting = [await send(eng.erase(0)), await send(eng.erase(0))]
        await env.step()  # then the actor takes them: both wait
        assert erases_waiting(env, 0) == 2
        with pytest.raises(EngineBusy, match="erase"):
            await env.call(eng.erase(0))
        queued = eng.submit(GenRequest(0, prompt="busy", n_predict=1))
        await env.step()
        assert eng.snapshot(0).queued == 1  # a job queued behind the erases
        assert env.timers.fire() >= 2  # their time is up while the slot still works
        for task in waiting:
            with pytest.raises(EngineBusy, match="stayed busy"):
                await task
        running.cancel()
        await env.finish(running)
        # nothing was erased: the queued job reuses what the slot held
        assert (await env.finish(queued)).cached_tokens > 0


@pytest.mark.asyncio
async def test_erase_of_an_idle_slot_is_immediate_and_a_waiter_that_leaves_frees_the_queue():
    async with scripted_engine(n_ctx_slot=4096, stepped=True) as env:
        eng = env.engine
        await env.run(GenRequest(1, prompt="abc", n_predict=1))
        assert await eng.erase(1) > 0 and eng.snapshot(1).n_past == 0
        running = await env.long_generation(0)
        erase = await send(eng.erase(0))
        await env.step()
        assert erases_waiting(env, 0) == 1
        with pytest.raises(EngineBusy):  # a job that may not wait is refused, as for a busy slot
            await env.finish(eng.submit(GenRequest(0, prompt="q", n_predict=1, wait=False)))
        erase.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await erase  # its waiter went with it: nothing awaited a step
        assert all(f.done() for f in eng.actor.slots[0].erase_waiters)  # the waiter gone
        running.cancel()
        await env.finish(running)
        assert not env.held and env.watch.idle  # the actor did all it would between steps
        assert eng.snapshot(0).n_past > 0  # not erased
