"""What a slot's snapshot says about progress, step by step on the scripted backend: rates,
``waiting_on`` (client, queue, reload, transfer) and the paused-on-client job. The engine runs
step by step (tests/engine_env.py): a test lets a step run, then reads the snapshot it
published. The same over TCP with the real model: test_slot_progress."""
from __future__ import annotations

import asyncio

import pytest

from engine.jobs import EngineBusy, GenJob, GenRequest
from engine.rates import WINDOW, RateWindow, rate
from tests.engine_env import run, scripted_engine


def test_rate_is_read_at_read_time_and_falls_to_zero():
    w = RateWindow()
    w.restart(0, 100.0)
    for i in range(1, 9):
        w.record(i * 10, 100.0 + i * 0.25)  # 40 tokens/s for 2 s
    samples = w.frozen()
    assert rate(samples, 80, 102.0) == pytest.approx(40.0, rel=0.2)
    # nothing moved since: the same frozen samples read later give a smaller rate, then 0
    assert 0 < rate(samples, 80, 103.0) < rate(samples, 80, 102.0)
    assert rate(samples, 80, 102.0 + WINDOW + 0.5) == 0.0
    assert len(samples) <= WINDOW / 0.25 + 2  # a snapshot copies a handful of pairs


@pytest.mark.asyncio
async def test_decoding_slot_reports_rate_eta_and_recent_progress():
    async with scripted_engine(n_ctx_slot=4096, stepped=True) as env:
        eng = env.engine
        job = await env.long_generation(0)
        await env.step(4)  # the prompt and a token, then a token a step
        snap = eng.snapshot(0)
        assert snap.n_decoded > 3  # tokens decoded
        now = snap.last_progress
        assert snap.operation == "decode" and snap.waiting_on is None and snap.queue_position is None
        assert snap.tokens_per_s(now) > 0 and snap.eta_ms(now) > 0
        assert snap.ms_since_progress(now) == 0 and snap.elapsed_ms(now) > 0
        assert snap.n_remain == snap.tokens_total - snap.tokens_processed > 0
        assert eng.info().slot_states == ("decode", "idle")
        job.cancel()
        await env.step()  # it ends with the step in flight
        idle = eng.snapshot(0)
        assert not idle.busy
        assert idle.ms_since_progress(now) is None and idle.tokens_per_s(now) == 0 and idle.n_remain == 0


@pytest.mark.asyncio
async def test_a_job_whose_client_is_not_reading_pauses_and_says_client():
    async with scripted_engine(n_ctx_slot=4096, stepped=True) as env:
        eng = env.engine
        job = await env.long_generation(0)
        job.set_client_blocked(True)
        await env.step()  # the step in flight ends; then the actor sees the job paused: idle
        assert eng.snapshot(0).waiting_on == "client" and not env.held
        paused = eng.snapshot(0).tokens_processed
        # the actor keeps serving other work, and never steps the paused job meanwhile
        res = await env.run(GenRequest(1, prompt="x", n_predict=5))
        assert res.tokens_generated == 5
        snap = eng.snapshot(0)
        assert snap.tokens_processed == paused and snap.is_processing
        later = snap.last_progress + 1.0
        assert snap.ms_since_progress(later) > snap.ms_since_progress(snap.last_progress)
        job.set_client_blocked(False)
        await env.step()
        assert eng.snapshot(0).tokens_processed > paused  # the job resumes
        assert eng.snapshot(0).waiting_on is None
        # a client that goes away while its job is paused: the job is reaped at once
        job.set_client_blocked(True)
        await env.step()
        assert eng.snapshot(0).waiting_on == "client" and not env.held  # paused again
        job.cancel()
        await env.wait_for(job.finished, "the paused job reaped")  # no step released: the cancel wakes the actor
        await env.settled()
        res = await job.result()
        assert res.stop_reason == "cancelled" and not eng.snapshot(0).busy


@pytest.mark.asyncio
async def test_jobs_behind_another_say_queue_and_position():
    async with scripted_engine(n_ctx_slot=4096, stepped=True) as env:
        eng = env.engine
        first = await env.long_generation(0)
        second = eng.submit(GenRequest(0, prompt="b", n_predict=1))
        await env.step()  # the actor takes the job after the step in flight
        assert eng.snapshot(0).queue_position == 1  # one queued
        third = eng.submit(GenRequest(0, prompt="c", n_predict=1))
        await env.step()
        assert eng.snapshot(0).queue_position == 2  # two queued
        snap = eng.snapshot(0)
        assert snap.waiting_on == "queue" and snap.queued_jobs == (second.id, third.id)
        first.cancel()
        await env.finish(second)
        await env.finish(third)
        assert eng.snapshot(0).waiting_on is None


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["serve-old", "reject"])
async def test_work_held_by_a_pending_reload_says_reload(policy):
    async with scripted_engine(n_ctx_slot=4096, reload_policy=policy, stepped=True) as env:
        eng = env.engine
        busy = await env.long_generation(0)  # keeps the reload draining
        await env.call(eng.configure({"model_path": "model-b"}))
        await env.builds_done(1)
        await env.step()  # the actor takes the built model after this step: draining
        assert eng.reload.state.value == "draining"  # reload draining
        if policy == "serve-old":  # new work waits for the swap
            held = eng.submit(GenRequest(1, prompt="x", n_predict=1))
        else:  # new work is refused until the swap
            with pytest.raises(EngineBusy):
                eng.submit(GenRequest(1, prompt="x", n_predict=1))
        await env.step()  # published while draining (serve-old: with the job the actor took after it)
        if policy == "serve-old":
            assert eng.snapshot(1).queued == 1  # job held
        assert eng.snapshot(1).waiting_on == "reload"  # slot 1 says reload
        assert eng.snapshot(0).waiting_on is None  # the draining job itself advances
        busy.cancel()
        await env.step()  # the last step of the draining job; the swap follows it
        assert eng.reload.state.value == "swapped"
        if policy == "serve-old":
            await env.finish(held)
        assert eng.snapshot(1).waiting_on is None  # nothing held


@pytest.mark.asyncio
async def test_a_state_transfer_says_transfer():
    async with scripted_engine() as env:
        eng, gate = env.engine, env.factory.decode_gate
        await run(eng, GenRequest(0, prompt="abc", n_predict=2))
        size = env.model.state_seq_size

        def held_size(seq: int) -> int:  # the transfer's first model call waits at the gate
            gate.pass_through()
            return size(seq)

        env.model.state_seq_size = held_size
        gate.close()
        task = asyncio.ensure_future(eng.state_get(0))
        try:
            await gate.wait_held(1, "the transfer's first model call")  # published before it
            assert eng.snapshot(0).waiting_on == "transfer"
            assert eng.info().slot_states[0] == "transfer"
        finally:
            gate.open()
        (await task).release()


@pytest.mark.asyncio
async def test_model_states_follow_the_reloads():
    from tests.scripted_backend import ScriptedFactory

    async with scripted_engine(backend=ScriptedFactory(fail={"model-c"})) as env:
        eng = env.engine
        assert eng.model_states() == {"a": "loaded", "b": "unloaded", "c": "unloaded"}
        await eng.swap_model("c")
        await env.builds_done(1)
        await env.wait_for(lambda: eng.reload.state.value == "failed", "the build of c failed")
        assert eng.model_states()["c"] == "failed"
        env.factory.build_gate.close()
        await eng.swap_model("b")
        assert eng.model_states() == {"a": "loaded", "b": "loading", "c": "unloaded"}
        env.factory.build_gate.open()
        await env.wait_for(lambda: eng.model_states()["b"] == "loaded", "b swapped in")
        assert eng.model_states()["a"] == "unloaded"


def test_an_idle_slots_snapshot_is_reused_only_while_nothing_it_shows_changed():
    """Idle slots give back their previous snapshot (the actor publishes every slot after every
    step); every change to what an idle slot shows must still reach its next snapshot."""
    from engine.sampling import SamplerParams
    from engine.slots import Slot
    from engine.status import ModelIdentity

    slot, ident = Slot(1), ModelIdentity(model_path="a.gguf", n_vocab=512)
    args = [3, ident, False]
    first = slot.snapshot(*args)
    assert slot.snapshot(*args) is first  # nothing changed: not built again

    def job(n: int) -> GenJob:
        return GenJob(GenRequest(slot=1, n_predict=n, sampling=SamplerParams(temperature=0.1 * n), stop=[f"s{n}"]))

    changes = [
        lambda: slot.tokens.extend([5, 6, 7]),
        lambda: setattr(slot, "state_size", 4096),
        lambda: setattr(slot, "transferring", True),
        lambda: setattr(slot, "transferring", False),
        lambda: setattr(slot, "generation", 2),
        lambda: setattr(slot, "last_job", job(4)),
        lambda: setattr(slot, "last_job", job(9)),
        lambda: (setattr(slot, "tokens_processed", 12), setattr(slot, "tokens_total", 40)),
        lambda: (setattr(slot, "started", 5.0), setattr(slot, "last_progress", 6.5)),
        lambda: (setattr(slot, "n_decoded", 11), setattr(slot, "has_new_line", True)),
        lambda: slot.tokens.clear(),  # config_generation follows the engine's again
        lambda: args.__setitem__(0, 4),  # a reload went live
        lambda: args.__setitem__(1, ModelIdentity(model_path="b.gguf", n_vocab=512)),
        lambda: args.__setitem__(2, True),  # a pending reload holds new work
        lambda: slot.queue.append(job(2)),  # a job waits: no longer idle
        lambda: slot.queue.clear(),
        lambda: setattr(slot, "operation", "state_put"),
        lambda: setattr(slot, "operation", "idle"),
    ]
    for i, change in enumerate(changes):
        before = slot.snapshot(*args)
        change()
        after = slot.snapshot(*args)
        assert after == slot._build_snapshot(*args), f"change {i}: a stale snapshot"
        assert after != before, f"change {i} is not visible"
