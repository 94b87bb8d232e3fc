"""The reload state machine step by step on the scripted backend: shadow and in-place,
supersede and join, failed builds, the drain timeout, the reject policy, config generations,
and requests pinned to the model they named. Builds are held at a gate (``wait_held``: the
build started; ``env.builds_done``: it is back at the actor's mailbox), decode steps run one
at a time when the test says (``env.step``, tests/engine_env.py), and so does the drain
timeout. (Over TCP with real models: test_reload.)"""
from __future__ import annotations

import asyncio

import pytest

from engine.jobs import EngineBusy, GenRequest, ModelChanged, ReloadFailed
from engine.reloader import BuildDone, Generations
from engine.status import ReloadState
from tests.engine_env import run, scripted_engine

LOADING, DRAINING, SWAPPED, FAILED, DROPPED = (ReloadState.LOADING, ReloadState.DRAINING, ReloadState.SWAPPED,
                                               ReloadState.FAILED, ReloadState.DROPPED)


def test_generations_are_unique_and_monotonic():
    g = Generations()
    assert g.live == 1
    reserved = g.reserve()
    assert reserved == 2 and g.live == 1
    assert g.go_live(reserved) == 2 == g.live  # nothing in between: the promise holds
    reserved = g.reserve()
    assert g.apply() == 4  # a T1 while the reload is pending takes the next number
    assert g.go_live(reserved) == 5 and g.live == 5  # never 3: that would go back


@pytest.mark.asyncio
async def test_shadow_reload_serves_old_while_loading_then_drains_and_swaps():
    async with scripted_engine(n_ctx_slot=4096, stepped=True) as env:
        eng, f = env.engine, env.factory
        old = env.model
        g0 = eng.generation
        f.build_gate.close()
        long = await env.long_generation(0)
        out = await env.call(eng.configure({"model_path": "model-b"}))
        assert out.tier == "T3" and out.config_generation == g0 + 1 and out.reload is LOADING
        await f.build_gate.wait_held(1, "the shadow build")
        assert (eng.reload.progress, eng.reload.load_stage) == (0.5, "tensors")  # what the build reported
        served_old = await env.run(GenRequest(1, prompt="meanwhile", n_predict=1))  # serve-old while loading
        assert served_old.config_generation == g0 and served_old.identity.model_name == "model-a"
        f.build_gate.open()
        await env.builds_done(1)
        await env.step()  # the actor takes the built model after the step in flight
        assert eng.reload.state is DRAINING
        queued = GenRequest(1, prompt="new", n_predict=1)  # new work waits for the swap
        queued = eng.submit(queued)
        await env.step()
        assert eng.snapshot(1).queued == 1  # queued behind the drain
        assert eng.actor.model is old and eng.generation == g0
        long.cancel()
        assert (await env.finish(long)).config_generation == g0  # ended on the old model
        res = await env.finish(queued)
        assert res.config_generation == g0 + 1 and res.identity.model_name == "model-b"
        assert eng.reload.state is SWAPPED and eng.generation == g0 + 1 and eng.reload.generation == g0 + 1
        assert (eng.reload.progress, eng.reload.load_stage) == (1.0, "done")
        await env.wait_for(lambda: old.closed, "the old model freed off-loop")  # on the loader thread

@pytest.mark.asyncio
async def test_inplace_reload_drains_frees_then_builds():
    async with scripted_engine(reload_mode="inplace", n_ctx_slot=4096, stepped=True) as env:
        eng, f = env.engine, env.factory
        old = env.model
        long = await env.long_generation(0)
        out = await env.call(eng.configure({"model_path": "model-b"}))
        assert out.reload is DRAINING and len(f.built) == 1  # nothing is built before the drain
        f.build_gate.close()
        long.cancel()
        await env.finish(long)
        await f.build_gate.wait_held(1, "the build after the drain")
        assert old.closed and eng.actor.model is None and eng.reload.state is LOADING and not eng.ready
        f.build_gate.open()
        assert await eng.wait_reload(out.reload_ticket) == eng.generation
        assert eng.actor.model.params.model_path == "model-b" and eng.ready

@pytest.mark.asyncio
async def test_inplace_past_the_point_of_no_return():
    """Once the old model is freed, the drain timeout no longer applies, and a newer config
    is built after the one in flight (never an engine left without a model)."""
    async with scripted_engine(reload_mode="inplace") as env:
        eng, f = env.engine, env.factory
        f.build_gate.close()
        first = await eng.configure({"model_path": "model-b"})
        await f.build_gate.wait_held(1, "b building, the old model freed")
        assert eng.actor.model is None
        assert env.timers.fire() == 1
        await eng.configure({})  # a mailbox round trip: the timeout message has been handled
        assert eng.reload.state is LOADING
        second = await eng.configure({"model_path": "model-c"})
        f.build_gate.open()
        with pytest.raises(ReloadFailed, match="superseded"):
            await eng.wait_reload(first.reload_ticket)
        await eng.wait_reload(second.reload_ticket)
        assert eng.identity.model_name == "model-c" and eng.ready


@pytest.mark.asyncio
async def test_failed_build_keeps_serving_and_inplace_restores_the_old_model():
    async with scripted_engine() as env:
        eng, f = env.engine, env.factory
        g0 = eng.generation
        f.fail.add("model-b")
        out = await eng.configure({"model_path": "model-b"})
        with pytest.raises(ReloadFailed, match="cannot load model-b"):
            await eng.wait_reload(out.reload_ticket)
        assert eng.reload.state is FAILED and eng.generation == g0 and eng.actor.model.params.model_path == "model-a"
        assert (await run(eng, GenRequest(0, prompt="x", n_predict=1))).config_generation == g0
    async with scripted_engine(reload_mode="inplace") as env:
        eng, f = env.engine, env.factory
        f.fail.add("model-b")
        out = await eng.configure({"model_path": "model-b"})
        with pytest.raises(ReloadFailed):
            await eng.wait_reload(out.reload_ticket)
        await env.wait_for(lambda: eng.ready, "the old model rebuilt")  # on the loader thread
        assert eng.actor.model.params.model_path == "model-a" and len(f.built) == 2
        assert (await run(eng, GenRequest(0, prompt="x", n_predict=1))).stop_reason == "length"


@pytest.mark.asyncio
async def test_newer_config_supersedes_pending_and_same_config_joins():
    async with scripted_engine() as env:
        eng, f = env.engine, env.factory
        f.build_gate.close()
        first = await eng.configure({"model_path": "model-b"})
        joined = await eng.configure({"model_path": "model-b"})
        assert joined.reload_ticket is first.reload_ticket  # asking again joins the pending reload
        await f.build_gate.wait_held(1, "b building")
        second = await eng.configure({"model_path": "model-c"})
        assert second.config_generation > first.config_generation
        f.build_gate.open()
        with pytest.raises(ReloadFailed, match="superseded"):
            await eng.wait_reload(first.reload_ticket)
        assert await eng.wait_reload(second.reload_ticket) == second.config_generation == eng.generation
        assert eng.identity.model_name == "model-c"
        b = next(m for m in f.built if m.params.model_path == "model-b")
        await env.wait_for(lambda: b.closed, "the superseded build closed")  # on the loader thread


@pytest.mark.asyncio
async def test_superseding_a_draining_reload_admits_what_waited_for_it():
    async with scripted_engine(n_ctx_slot=4096, stepped=True) as env:
        eng, f = env.engine, env.factory
        long = await env.long_generation(0)
        await env.call(eng.configure({"model_path": "model-b"}))
        await env.builds_done(1)
        await env.step()
        assert eng.reload.state is DRAINING  # b built, draining
        waiting = GenRequest(1, prompt="w", n_predict=1)
        waiting = eng.submit(waiting)
        await env.step()
        assert eng.snapshot(1).queued == 1  # queued behind the drain
        f.build_gate.close()
        await env.call(eng.configure({"model_path": "model-c"}))  # b dropped; c loads beside the live model
        assert eng.reload.state is LOADING
        assert (await env.finish(waiting)).identity.model_name == "model-a"  # no longer waits for a drain
        long.cancel()


@pytest.mark.asyncio
async def test_config_asking_for_the_live_model_drops_the_pending_reload():
    async with scripted_engine() as env:
        eng, f = env.engine, env.factory
        f.build_gate.close()
        pending = await eng.configure({"model_path": "model-b"})
        back = await eng.configure({"model_path": "model-a"})
        assert back.unchanged_keys == ["model_path"] and eng.reload.state is DROPPED
        f.build_gate.open()
        with pytest.raises(ReloadFailed, match="live model"):
            await eng.wait_reload(pending.reload_ticket)
        assert eng.identity.model_name == "model-a"


@pytest.mark.asyncio
async def test_drain_timeout_drops_the_reload_and_admits_queued_work():
    async with scripted_engine(n_ctx_slot=4096, stepped=True) as env:
        eng, f = env.engine, env.factory
        g0 = eng.generation
        long = await env.long_generation(0)
        out = await env.call(eng.configure({"n_ctx": 2048}))
        await env.builds_done(1)
        await env.step()
        assert eng.reload.state is DRAINING  # built, waiting for slot 0
        waiting = GenRequest(1, prompt="w", n_predict=1)
        waiting = eng.submit(waiting)
        await env.step()
        assert eng.snapshot(1).queued == 1  # queued behind the drain
        assert env.timers.fire() == 1
        with pytest.raises(ReloadFailed, match="drain timeout"):
            await env.call(eng.wait_reload(out.reload_ticket))  # the timeout is handled between two steps
        assert eng.reload.state is DROPPED and "[0]" in eng.reload.error and eng.generation == g0
        assert (await env.finish(waiting)).config_generation == g0
        shadow = next(m for m in f.built if m.params.n_ctx == 2048)
        await env.wait_for(lambda: shadow.closed, "the dropped shadow closed")  # on the loader thread
        long.cancel()


@pytest.mark.asyncio
async def test_reject_policy_answers_busy_while_a_reload_is_pending():
    async with scripted_engine(reload_policy="reject") as env:
        eng, f = env.engine, env.factory
        f.build_gate.close()
        out = await eng.configure({"model_path": "model-b"})
        with pytest.raises(EngineBusy, match="reloading") as e:
            eng.submit(GenRequest(0, prompt="x", n_predict=1))
        # the hint is a value, not a timing: the last load's duration, floored at 500 ms
        assert e.value.retry_after_ms == int(max(eng.reload.load_ms, 500))
        f.build_gate.open()
        await eng.wait_reload(out.reload_ticket)
        assert (await run(eng, GenRequest(0, prompt="x", n_predict=1))).identity.model_name == "model-b"


@pytest.mark.asyncio
async def test_select_model_waits_for_its_reload_and_pins_the_request():
    async with scripted_engine(n_ctx_slot=4096, stepped=True) as env:
        eng = env.engine
        choice = await eng.select_model("b")
        assert choice.name == "b" and not choice.fallback and choice.params.model_path == "model-b"
        assert eng.identity.model_name == "model-b"
        res = await env.run(GenRequest(0, prompt="x", n_predict=1, params=choice.params))
        assert res.identity.model_name == "model-b"
        unknown = await eng.select_model("gpt-4")
        assert unknown.fallback and unknown.params is None and unknown.name == "model-b"
        assert not (await eng.select_model("model-b")).fallback  # the resident model's own name
        # a swap between choosing and running: the pinned job fails rather than run on model-c
        long = await env.long_generation(0)
        pinned = GenRequest(1, prompt="z", n_predict=1, params=(await env.call(eng.select_model("b"))).params)
        await env.call(eng.configure({"model_path": "model-c"}))
        await env.builds_done(2)  # model-b's, then model-c's
        await env.step()
        assert eng.reload.state is DRAINING  # model-c built
        pinned = eng.submit(pinned)
        await env.step()
        assert eng.snapshot(1).queued == 1  # pinned job queued behind the drain
        long.cancel()
        with pytest.raises(ModelChanged, match="replaced before it ran"):
            await env.finish(pinned)
        assert eng.identity.model_name == "model-c"

@pytest.mark.asyncio
async def test_select_model_is_judged_by_the_actor_not_before_a_swap_it_races():
    """The alias's model is compared with the live one inside the actor: judged beforehand, an
    in-place swap landing between the check and the Configure pinned a request naming ``a`` to
    model-b. Whatever the interleaving, the request is pinned to the model it names."""
    async with scripted_engine(reload_mode="inplace") as env:
        eng, f = env.engine, env.factory
        f.build_gate.close()
        await eng.configure({"model_path": "model-b"})
        await f.build_gate.wait_held(1, "the in-place build of model-b")
        f.build_gate.open()
        # woken as BuildDone is posted, before the actor (woken by the same post) takes it: the
        # select_model's Configure goes into the mailbox right behind it
        await env.builds_done(1)
        assert env.watch.handled[BuildDone] == 0  # posted, not yet handled
        choice = await eng.select_model("a")
        assert choice.params.model_path == "model-a"
        assert eng.params.model_path == "model-a"


@pytest.mark.asyncio
async def test_t1_during_a_pending_reload_gets_its_own_generation():
    """Issue 13 item 11, step by step: the T1 neither reuses the reload's generation nor
    releases the request that waits for the reload."""
    async with scripted_engine() as env:
        eng, f = env.engine, env.factory
        f.build_gate.close()
        waiter = asyncio.ensure_future(eng.select_model(None, {"model_path": "model-b"}))
        await env.wait_for(lambda: eng.reload.pending, "the PREFILL's reload pending")
        t1 = await eng.configure({"sampling.temp": 0.5})
        assert t1.config_generation != eng.reload.generation and t1.config_generation == eng.generation
        assert not waiter.done()
        f.build_gate.open()
        choice = await waiter
        assert choice.params.model_path == "model-b" and eng.generation > t1.config_generation
        res = await run(eng, GenRequest(0, prompt="x", n_predict=1, params=choice.params))
        assert res.identity.model_name == "model-b" and res.config_generation == eng.generation
