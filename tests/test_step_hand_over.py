"""A step that runs many decodes hands its tokens to their streams as it makes them, and
ends at once when the actor has mail (engine.stepper: ``hand_over``, ``should_yield``).
Step by step on the scripted backend: every decode waits at the closed decode gate."""
from __future__ import annotations

import pytest

from engine import stepper
from engine.jobs import GenRequest
from tests.engine_env import scripted_engine


@pytest.mark.asyncio
async def test_a_long_step_hands_its_tokens_over_while_it_runs(monkeypatch):
    monkeypatch.setattr(stepper, "HAND_OVER_EVERY", 0.0)  # every decode's token, however fast
    async with scripted_engine(time_slice=3600.0) as env:
        gate, actor = env.factory.decode_gate, env.engine.actor
        gate.close()
        job = env.engine.submit(GenRequest(0, prompt="abc", n_predict=6))
        await gate.wait_held(1, "the prefill")
        gate.release(1)  # the prefill's step ends with its first token
        await gate.wait_held(1, "the first decode of the next step")
        steps = actor.stats["steps"]
        first = await job.next_event()
        for k in range(3):  # each decode's token reaches the stream while the step still runs
            gate.release(1)
            await gate.wait_held(1, f"decode {k + 2} of the same step")
            event = await job.next_event()
            assert event is not None and actor.stats["steps"] == steps
        gate.open()
        rest = [ev async for ev in _events(job)]
    assert first is not None and len(rest) == 2  # six tokens in all, each once
    assert (await job.result()).tokens_generated == 6


@pytest.mark.asyncio
async def test_a_long_step_ends_at_once_for_mail():
    async with scripted_engine(time_slice=3600.0) as env:
        gate, actor = env.factory.decode_gate, env.engine.actor
        gate.close()
        first = env.engine.submit(GenRequest(0, prompt="abc", n_predict=50))
        await gate.wait_held(1, "the prefill")
        gate.release(1)
        await gate.wait_held(1, "the first decode of a long step")
        steps = actor.stats["steps"]
        second = env.engine.submit(GenRequest(1, prompt="xyz", n_predict=1))  # mail for the actor
        await env.wait_for(lambda: not actor._mailbox.empty() or actor.stats["steps"] > steps, "the submit posted")
        gate.release(1)  # one more decode: then the step must end, not run on to its slice
        await env.wait_for(lambda: actor.stats["steps"] > steps, "the step ended")
        gate.open()
        assert (await second.result()).tokens_generated == 1
        assert (await first.result()).tokens_generated == 50


async def _events(job):
    while (ev := await job.next_event()) is not None:
        yield ev
