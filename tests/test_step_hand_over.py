"""A step that runs many decodes hands its tokens to their streams as it makes them, and
ends at once when the actor has mail (engine.stepper: ``hand_over``, ``should_yield``).
Step by step on the scripted backend: every decode waits at the closed decode gate."""
from __future__ import annotations

import asyncio
import threading

import pytest

from engine import actor as actor_module
from engine import stepper
from engine.checkpoints import END_OFFSET
from engine.jobs import GenRequest
from tests.engine_env import scripted_engine
from tests.scripted_backend import ScriptedFactory


@pytest.mark.asyncio
async def test_a_long_step_hands_its_tokens_over_while_it_runs(monkeypatch):
    monkeypatch.setattr(stepper, "HAND_OVER_EVERY", 0.0)  # every decode's token, however fast
    async with scripted_engine(time_slice=3600.0) as env:
        gate, actor = env.factory.decode_gate, env.engine.actor
        job = await _into_a_long_step(env, GenRequest(0, prompt="abc", n_predict=6))
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
async def test_a_fast_models_tokens_go_over_together_once_the_hand_over_interval_passed(monkeypatch):
    """A hand-over wakes the event loop, which takes a core from a compute thread: a model that
    makes a token every ~0.2 ms hands them over in batches, not one wake-up each. Within the
    interval the tokens wait in the step; they all reach the stream when it ends."""
    monkeypatch.setattr(stepper, "HAND_OVER_EVERY", 3600.0)
    async with scripted_engine(time_slice=3600.0) as env:
        gate, actor = env.factory.decode_gate, env.engine.actor
        job = await _into_a_long_step(env, GenRequest(0, prompt="abc", n_predict=6))
        steps = actor.stats["steps"]
        first = await job.next_event()  # the first token ended its step: it went at once
        for k in range(3):
            gate.release(1)
            await gate.wait_held(1, f"decode {k + 2} of the same step")
        for _ in range(5):  # a hand-over posted from the inference thread would run by now
            await asyncio.sleep(0)
        assert job._job.events.qsize() == 0 and actor.stats["steps"] == steps
        gate.open()
        rest = [ev async for ev in _events(job)]
    assert first is not None and len(rest) == 5  # six tokens in all, each once
    assert (await job.result()).tokens_generated == 6


@pytest.mark.asyncio
async def test_a_long_step_ends_at_once_for_mail():
    async with scripted_engine(time_slice=3600.0) as env:
        gate, actor = env.factory.decode_gate, env.engine.actor
        first = await _into_a_long_step(env, GenRequest(0, prompt="abc", n_predict=50))
        steps = actor.stats["steps"]
        second = env.engine.submit(GenRequest(1, prompt="xyz", n_predict=1))  # mail for the actor
        await env.wait_for(lambda: not actor._mailbox.empty() or actor.stats["steps"] > steps, "the submit posted")
        gate.release(1)  # one more decode: then the step must end, not run on to its slice
        await env.wait_for(lambda: actor.stats["steps"] > steps, "the step ended")
        gate.open()
        assert (await second.result()).tokens_generated == 1
        assert (await first.result()).tokens_generated == 50


@pytest.mark.asyncio
async def test_a_job_cancelled_during_a_long_step_is_not_fed_again_and_the_others_go_on(monkeypatch):
    monkeypatch.setattr(stepper, "HAND_OVER_EVERY", 0.0)
    async with scripted_engine(time_slice=3600.0) as env:
        gate, actor = env.factory.decode_gate, env.engine.actor
        gate.close()
        kept = env.engine.submit(GenRequest(0, prompt="abc", n_predict=8))
        dropped = env.engine.submit(GenRequest(1, prompt="xyz", n_predict=50))
        firsts = [asyncio.ensure_future(job.next_event()) for job in (kept, dropped)]
        while not all(f.done() for f in firsts):  # decode by decode until both have a token
            await gate.wait_held(1, "the next decode")
            gate.release(1)
            await env.wait_for(lambda: gate.held or all(f.done() for f in firsts), "a decode done")
        await gate.wait_held(1, "a decode of a long step serving both")
        steps, model = actor.stats["steps"], env.model
        at_cancel = len(model.batches)  # the held decode is not recorded yet; it still feeds both
        dropped.cancel()  # a flag, not mail: the step goes on for the job still wanted
        gate.release(1)
        await gate.wait_held(1, "the next decode of the same step")
        assert actor.stats["steps"] == steps
        gate.open()
        assert (await kept.result()).tokens_generated == 8
        assert (await dropped.outcome()).stop_reason == "cancelled"
        later = model.batches[at_cancel + 1:]
        assert later and all(batch == [(0, 1)] for batch in later)  # slot 1 not fed after the cancel


@pytest.mark.asyncio
async def test_snapshots_answer_while_a_long_step_runs_and_catch_up_when_it_ends():
    async with scripted_engine(time_slice=3600.0) as env:
        gate = env.factory.decode_gate
        job = await _into_a_long_step(env, GenRequest(0, prompt="abc", n_predict=6))
        during = env.engine.snapshot(0)  # read without the mailbox while the step is in flight
        assert during.is_processing and during.job_id == job.id
        gate.release(2)
        await gate.wait_held(1, "a third decode of the same step")
        assert env.engine.snapshot(0).n_past == during.n_past  # published after the step, not within it
        gate.open()
        result = await job.result()
        await env.wait_for(lambda: not env.engine.snapshot(0).is_processing, "the end published")
        assert env.engine.snapshot(0).n_past == result.n_past > during.n_past


@pytest.mark.asyncio
async def test_a_steps_readers_run_before_its_snapshots_unless_a_job_ended_in_it():
    """After a step the actor gives the readers its tokens woke their turn (a stream writes its
    token there) and publishes the snapshots after it: a token's write does not wait for them.
    A step in which a job ended publishes first: its result's readers see the slot it left."""
    seen: list[tuple[int, int]] = []  # (steps run, steps published) when a token is read
    async with scripted_engine() as env:  # time_slice 0: one decode per step, its token after it
        actor = env.engine.actor
        job = env.engine.submit(GenRequest(0, prompt="abc", n_predict=4))
        async for _ in _events(job):
            seen.append((actor.stats["steps"], env.watch.published_step))
        result = await job.result()
        assert env.watch.published_step == actor.stats["steps"] and not env.engine.snapshot(0).is_processing
        assert env.engine.snapshot(0).n_past == result.n_past
    assert len(seen) == 4
    assert [published for _, published in seen[:3]] == [steps - 1 for steps, _ in seen[:3]]
    assert seen[3][1] == seen[3][0]  # the job's last token: its step ended it


async def _into_a_long_step(env, request: GenRequest):
    """Submit ``request`` with the decode gate closed and let its prefill's step through: the
    job's next step is held at its first decode (the step is in flight). Returns the job."""
    gate = env.factory.decode_gate
    gate.close()
    job = env.engine.submit(request)
    await gate.wait_held(1, "the prefill")
    gate.release(1)  # the prefill's step ends with its first token
    await gate.wait_held(1, "the first decode of a long step")
    return job


async def _events(job):
    while (ev := await job.next_event()) is not None:
        yield ev


@pytest.mark.asyncio
async def test_the_step_after_a_first_token_gives_way_on_the_inference_thread(monkeypatch):
    """Before its decode, the step after one that gave a job its first token lets what that
    token's write woke run (``executors.give_way``: the client reading it, on this host). No
    other step does: not the first from idle (nothing was written just before it; the new
    request's own client may still be busy), nor those after later tokens (a steady stream's
    reader takes its turn as before, and decode keeps its pace)."""
    seen: list[tuple[str, int, int]] = []
    async with scripted_engine() as env:  # time_slice 0: one decode per step
        actor, model = env.engine.actor, env.model
        monkeypatch.setattr(actor_module, "give_way",
                            lambda: seen.append((threading.current_thread().name, actor.stats["steps"],
                                                 len(model.batches))))
        await env.wait_for(lambda: env.watch.idle, "the actor idle, awaiting its mailbox")
        for n in range(2):  # twice from idle
            steps, decodes = actor.stats["steps"], len(model.batches)
            job = env.engine.submit(GenRequest(n, prompt="abc", n_predict=5))
            assert (await job.result()).tokens_generated == 5
            assert actor.stats["steps"] - steps == 5
            mine = [(name, s - steps, d - decodes) for name, s, d in seen if s >= steps]
            # only step 1, after the prefill's step gave the first token; before its own decode
            assert [(s, d) for _, s, d in mine] == [(1, 1)]
            assert mine[0][0].startswith("hydra-inference")
            await env.wait_for(lambda: env.watch.idle, "the actor idle, awaiting its mailbox")


@pytest.mark.asyncio
async def test_the_tokens_held_back_for_the_last_checkpoint_go_in_the_prefills_step():
    """A model that takes context checkpoints (here a window cache that forgets) cuts a prompt
    END_OFFSET tokens before its end. The step goes on to those few tokens instead of ending
    after the first chunk: the first token comes one hand-off sooner."""
    factory = ScriptedFactory(n_swa=48, kv_shareable=False)
    async with scripted_engine(backend=factory, n_ctx_slot=64, time_slice=3600.0) as env:
        actor, model = env.engine.actor, env.model
        assert actor.cache.checkpoints.wanted(model)
        steps, decodes = actor.stats["steps"], len(model.batches)
        job = env.engine.submit(GenRequest(0, prompt="abcdefghijkl", n_predict=1))
        result = await job.result()
        assert result.tokens_generated == 1
        chunks = [n for batch in model.batches[decodes:] for _, n in batch]
        assert chunks[-1] == END_OFFSET and sum(chunks) == result.prompt_tokens  # cut at the checkpoint
        assert actor.stats["steps"] - steps == 1  # both chunks, and the token, in one step


@pytest.mark.asyncio
async def test_a_long_prompts_chunks_go_on_in_one_step_until_the_actor_has_mail():
    """A prompt of several batches is fed chunk after chunk in one step, as llama-server's loop
    goes on with no hand-off between (each costs 0.3–0.7 ms on the slower host); a request that
    arrives meanwhile ends the step after the chunk in flight, and is admitted in the next."""
    async with scripted_engine(n_slots=3, n_ctx_slot=256, time_slice=3600.0) as env:
        actor, gate, model = env.engine.actor, env.factory.decode_gate, env.model
        steps = actor.stats["steps"]
        result = await env.engine.submit(GenRequest(0, prompt="x" * 150, n_predict=1)).result()
        assert result.tokens_generated == 1 and result.prompt_tokens > 4 * model.n_batch
        assert actor.stats["steps"] - steps == 1  # five chunks and the first token, one step

        gate.close()
        steps, seen = actor.stats["steps"], len(model.batches)
        long = env.engine.submit(GenRequest(1, prompt="y" * 150, n_predict=1))
        await gate.wait_held(1, "the long prompt's first chunk")
        short = env.engine.submit(GenRequest(2, prompt="hi", n_predict=1))  # mail for the actor
        gate.open()
        assert (await short.result()).tokens_generated == 1 and (await long.result()).tokens_generated == 1
        firsts = [i for i, batch in enumerate(model.batches[seen:]) if any(seq == 2 for seq, _ in batch)]
        assert firsts == [1]  # the step ended after the chunk in flight; the next batch has it
        # that step; the next, which ends with the short job's one token; the rest in one
        assert actor.stats["steps"] - steps == 3


@pytest.mark.asyncio
async def test_a_decode_beside_a_long_prefill_keeps_the_batch_within_n_batch():
    """A job that decodes from its first step (a DECODE continuing a PREFILL, its logits kept)
    admitted after a job whose prompt needs several full batches: every batch still holds at
    most n_batch tokens, the decode's token first and the prompt's chunk in what is left."""
    async with scripted_engine(n_ctx_slot=256) as env:
        gate, model = env.factory.decode_gate, env.model
        await env.engine.submit(GenRequest(1, prompt="hi", n_predict=0, capture_state=True)).result()
        gate.close()
        long = env.engine.submit(GenRequest(0, prompt="x" * 150, n_predict=1))
        await gate.wait_held(1, "the long prompt's first chunk")
        decode = env.engine.submit(GenRequest(1, n_predict=4))  # admitted while the prompt is fed
        seen = len(model.batches)
        gate.open()
        assert (await decode.result()).tokens_generated == 4
        assert (await long.result()).tokens_generated == 1
    batches = model.batches[seen:]
    assert max(sum(n for _, n in batch) for batch in batches) <= model.n_batch == 32
    assert [n for batch in batches for seq, n in batch if seq == 1] == [1, 1, 1]  # one token a decode, each beside the chunk
    assert sum(n for batch in batches for seq, n in batch if seq == 0) == 151  # the BOS and 150 bytes, the held chunk's too


@pytest.mark.asyncio
async def test_a_short_prompt_is_not_held_behind_a_long_one():
    """The prompt chunks of a step go to the shortest remaining prompts first: a short prompt
    admitted while a long one is fed is computed in the next batch, with the long one's chunk
    in what it leaves, instead of after every chunk of the long one."""
    async with scripted_engine(n_ctx_slot=256) as env:
        gate, model = env.factory.decode_gate, env.model
        gate.close()
        long = env.engine.submit(GenRequest(0, prompt="x" * 150, n_predict=1))
        await gate.wait_held(1, "the long prompt's first chunk")
        short = env.engine.submit(GenRequest(1, prompt="hi", n_predict=1))
        gate.release(1)  # the step ends after its chunk; the next one has the short prompt admitted
        await gate.wait_held(1, "the next step's batch")
        gate.open()
        assert (await short.result()).tokens_generated == 1
        assert (await long.result()).tokens_generated == 1
    batches = model.batches
    with_short = [i for i, batch in enumerate(batches) if any(seq == 1 for seq, _ in batch)]
    with_long = [i for i, batch in enumerate(batches) if any(seq == 0 for seq, _ in batch)]
    assert len(with_short) == 1 and sorted(batches[with_short[0]]) == [(0, 32 - 3), (1, 3)]  # BOS and "hi"
    assert with_short[0] < with_long[-1] and all(sum(n for _, n in b) <= 32 for b in batches)


@pytest.mark.asyncio
async def test_a_slots_state_size_waits_one_step_after_its_first_token(monkeypatch):
    """The size of a slot's state walks every KV cell: the step that gives a job its first token
    hands it over without taking it, the next step takes it, and a job's end takes it at once."""
    monkeypatch.setattr(stepper, "STATE_SIZE_EVERY", 0.0)  # due at every step but the first token's
    async with scripted_engine(stepped=True) as env:  # time_slice 0: one decode per step
        job = env.engine.submit(GenRequest(0, prompt="abc", n_predict=3))
        await env.step()  # the prefill, and the first token
        assert await job.next_event() is not None
        assert env.engine.snapshot(0).state_size == 0
        await env.step()  # the first token decoded, the second sampled
        after_second = env.engine.snapshot(0).state_size
        assert after_second == env.model.state_seq_size(0) > 0
        await env.step()  # the last token: the job ends
        await job.result()
        assert env.engine.snapshot(0).state_size == env.model.state_seq_size(0) > after_second


def _queued(r) -> list:
    q, out = r.job.events, []
    while not q.empty():
        out.append(q.get_nowait())
    return out


@pytest.mark.asyncio
async def test_handed_over_tokens_reach_one_stream_a_turn_of_the_loop_and_in_order():
    """A hand-over that carries several streams' tokens puts one stream's into its queue per
    turn of the event loop (what arrived on a socket meanwhile waits for one stream's write,
    not for all); tokens put later for a stream (the step's end) come after what was staged."""
    from types import SimpleNamespace

    from engine.scheduler import Scheduler

    sched = Scheduler([], slot_queue=1, stats={"tokens_generated": 0})
    a, b, c = (SimpleNamespace(job=SimpleNamespace(events=asyncio.Queue())) for _ in range(3))
    sched.deliver([(a, [1, 2]), (b, [3]), (c, [4])])
    assert (_queued(a), _queued(b), _queued(c)) == ([1, 2], [], [])
    await asyncio.sleep(0)
    assert (_queued(b), _queued(c)) == ([3], [])
    await asyncio.sleep(0)
    assert _queued(c) == [4]
    sched.deliver([(a, [5]), (b, [6])])
    sched._put(b, [7])  # as after_step puts the rest of a step's tokens
    assert (_queued(a), _queued(b)) == ([5], [6, 7])
    assert sched.stats["tokens_generated"] == 7
    await asyncio.sleep(0)  # the turn scheduled for b finds nothing left
    assert (_queued(a), _queued(b)) == ([], [])


@pytest.mark.asyncio
async def test_streams_handed_over_a_token_at_a_time_get_every_token_in_order(monkeypatch):
    """Two streams in long steps, every decode handed over: each stream's text is the same as
    the job's result, token for token, and its end comes after its last token."""
    monkeypatch.setattr(stepper, "HAND_OVER_EVERY", 0.0)
    async with scripted_engine(time_slice=3600.0) as env:
        jobs = [env.engine.submit(GenRequest(i, prompt=p, n_predict=12)) for i, p in enumerate(("abc", "xyz"))]
        streamed = [[ev.piece async for ev in _events(job)] for job in jobs]
        results = [await job.result() for job in jobs]
    for pieces, res in zip(streamed, results):
        assert len(pieces) == res.tokens_generated == 12 and b"".join(pieces) == res.text


@pytest.mark.asyncio
async def test_a_job_whose_client_reads_only_the_result_keeps_its_tokens_until_the_step_ends(monkeypatch):
    """A client that awaits only the result (``GenRequest.stream`` False: a completion that is not
    streamed) does not read its tokens as they come: the step hands over the streamed job's
    tokens beside it, and keeps the other's until it ends, without a wake-up of the loop each."""
    monkeypatch.setattr(stepper, "HAND_OVER_EVERY", 0.0)  # every decode's tokens, however fast
    async with scripted_engine(time_slice=3600.0) as env:
        gate, actor = env.factory.decode_gate, env.engine.actor
        gate.close()
        streamed = env.engine.submit(GenRequest(0, prompt="abc", n_predict=6))
        whole = env.engine.submit(GenRequest(1, prompt="xyz", n_predict=6, stream=False))
        await gate.wait_held(1, "the two prefills")
        gate.release(1)  # that step ends with both first tokens
        await gate.wait_held(1, "the first decode of a long step")
        steps = actor.stats["steps"]
        assert await streamed.next_event() is not None
        held = whole._job.events.qsize()
        for k in range(3):
            gate.release(1)
            await gate.wait_held(1, f"decode {k + 2} of the same step")
            assert await streamed.next_event() is not None  # handed over while the step runs
            while actor.scheduler._staged:  # every hand-over posted so far has reached its queue
                await asyncio.sleep(0)
            assert whole._job.events.qsize() == held and actor.stats["steps"] == steps
        gate.open()
        results = [await job.result() for job in (streamed, whole)]
        rest = [ev async for ev in _events(whole)]
    assert len(rest) == 6 and all(r.tokens_generated == 6 for r in results)  # the first one held, then the rest


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [True, False])
async def test_only_a_streams_first_token_ends_its_step(stream):
    """A stream's first token ends the step that samples it, to reach its client at once (and the
    next step gives way to that client). A client that reads only the result has no use for its
    first token before the rest: its step goes on decoding."""
    async with scripted_engine(time_slice=3600.0) as env:
        gate, actor = env.factory.decode_gate, env.engine.actor
        gate.close()
        job = env.engine.submit(GenRequest(0, prompt="abc", n_predict=4, stream=stream))
        await gate.wait_held(1, "the prefill")
        steps = actor.stats["steps"]
        gate.release(1)  # the prefill: it samples the first token
        await gate.wait_held(1, "the decode of the first token")
        if stream:
            assert await job.next_event() is not None  # its step ended and handed it over
            await env.wait_for(lambda: actor.stats["steps"] == steps + 1, "the prefill's step counted")
        else:
            assert actor.stats["steps"] == steps and job._job.events.qsize() == 0  # the same step
        gate.open()
        result = await job.result()
    assert result.tokens_generated == 4


@pytest.mark.asyncio
async def test_no_step_gives_way_for_a_first_token_nobody_reads_yet(monkeypatch):
    """A first token of a job whose client reads only the result was written nowhere: no step
    gives way for it, even one that ended at it (here each step is one decode)."""
    seen: list[int] = []
    async with scripted_engine() as env:  # time_slice 0: one decode per step
        monkeypatch.setattr(actor_module, "give_way", lambda: seen.append(1))
        job = env.engine.submit(GenRequest(0, prompt="abc", n_predict=5, stream=False))
        assert (await job.result()).tokens_generated == 5
    assert seen == []
