"""A job that names no slot, step by step on the scripted backend: the actor picks the slot
when it admits the job (prompt similarity, then least recently used), so a burst spreads
over every slot; when all are busy the job waits in one shared, bounded queue.
(Over HTTP with the real model: test_prompt_cache_llama.)"""
from __future__ import annotations

import pytest

from engine.jobs import BadInput, EngineBusy, GenRequest
from engine.slot_choice import choose_slot
from engine.slots import Slot
from tests.engine_env import run, scripted_engine


@pytest.mark.asyncio
async def test_a_burst_spreads_over_every_slot_then_queues():
    async with scripted_engine(n_slots=4, slot_queue=2, stepped=True) as env:
        eng = env.engine
        jobs = [eng.submit(GenRequest(None, prompt=f"chat {i}", n_predict=2)) for i in range(12)]
        await env.settled()
        assert env.held  # the first step
        assert sorted(s.job_id is not None for s in eng.snapshots) == [True] * 4
        assert len(eng.actor.scheduler.unassigned) == 8  # 2 per slot
        extra = eng.submit(GenRequest(None, prompt="one too many", n_predict=2))  # handled after this step
        await env.step()
        with pytest.raises(EngineBusy, match="all 4 slots are busy"):
            await extra.result()
        results = [await env.finish(j) for j in jobs]
        assert {r.slot for r in results} == {0, 1, 2, 3}
        assert all(j.slot == r.slot for j, r in zip(jobs, results))


@pytest.mark.asyncio
async def test_a_returning_conversation_finds_its_slot_else_the_least_recently_used():
    async with scripted_engine(n_slots=3) as env:
        eng = env.engine
        a = await run(eng, GenRequest(None, prompt="apples are red, first turn", n_predict=2))
        b = await run(eng, GenRequest(None, prompt="bananas are yellow, first turn", n_predict=2))
        assert (a.slot, b.slot) == (0, 1)  # empty slots are the least recently used
        back = await run(eng, GenRequest(None, prompt="bananas are yellow, first turn" + "xy" + " and more",
                                     n_predict=2))
        assert back.slot == b.slot and back.cached_tokens > 20
        new = await run(eng, GenRequest(None, prompt="something else", n_predict=2))
        assert new.slot == 2
        other = await run(eng, GenRequest(None, prompt="yet another thing", n_predict=2))
        assert other.slot == a.slot  # slot 0 was used least recently
        pinned = await run(eng, GenRequest(2, prompt="bananas are yellow, first turn and more", n_predict=2))
        assert pinned.slot == 2  # an explicit slot is honoured
        with pytest.raises(BadInput, match="names no slot"):
            eng.submit(GenRequest(None, n_predict=2))


def test_choose_slot_by_similarity_threshold_then_lru():
    slots = [Slot(0, tokens=[1, 2, 3, 4], last_used=5), Slot(1, tokens=[1, 2, 9, 9], last_used=3),
             Slot(2, tokens=[], last_used=4)]
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    assert choose_slot(slots, prompt, 0.4).id == 0  # 4/8 = 0.5 > 0.4
    assert choose_slot(slots, prompt, 0.5).id == 1  # not strictly above: least recently used
    assert choose_slot(slots, prompt, 0.0).id == 1  # similarity off
    assert choose_slot(slots, None, 0.4).id == 1
    # with prefixes copied between slots, only a slot the prompt continues is picked by similarity
    assert choose_slot(slots, prompt, 0.4, shareable=True).id == 0  # the prompt continues slot 0
    slots[0].tokens = [1, 2, 3, 4] + [7] * 20  # another conversation sharing a 4-token "system prompt"
    assert choose_slot(slots, prompt + [9] * 30, 0.05, shareable=True).id == 1  # LRU, slot 0 kept
    assert choose_slot(slots, prompt + [9] * 30, 0.05, shareable=False).id == 0  # llama-server's choice
    slots[1].transferring = True
    assert choose_slot(slots, prompt, 0.5).id == 2
    for s in slots:
        s.job = object()
    assert choose_slot(slots, prompt, 0.4) is None


@pytest.mark.asyncio
async def test_a_short_input_is_tokenized_where_the_slot_is_chosen_a_long_one_on_the_inference_thread():
    """Choosing a slot by similarity needs the prompt's tokens: a short input is tokenized on
    the event loop (a round trip through the inference thread cost more than the tokenizing);
    with nothing running a longer one is too, a chat with tools included, up to a bound on what
    it renders; past it, or a long input or any chat with tools while a job runs, on the
    inference thread; either way only once."""
    import threading

    from engine.stepper import IDLE_LOOP_TOKENIZE_CHARS, LOOP_TOKENIZE_CHARS

    async with scripted_engine(n_slots=2, n_ctx_slot=1024) as env:
        model = env.engine.actor.model
        where: list[str] = []
        real = model.tokenize

        def tokenize(text, *args, **kwargs):
            where.append(threading.current_thread().name)
            return real(text, *args, **kwargs)

        def tokenized_on_loop() -> bool:
            return len(where) == 1 and where[0] == loop_thread

        def tokenized_on_inference_thread() -> bool:
            return len(where) == 1 and where[0].startswith("hydra-inference")

        model.tokenize = tokenize
        loop_thread = threading.current_thread().name
        await run(env.engine, GenRequest(None, prompt="short", n_predict=1))
        assert tokenized_on_loop()
        where.clear()
        await run(env.engine, GenRequest(None, prompt="x" * (LOOP_TOKENIZE_CHARS + 1), n_predict=1))
        assert tokenized_on_loop()  # nothing else runs: no stream waits for the loop
        where.clear()
        with pytest.raises(BadInput, match="does not fit"):  # tokenized first, then too long
            await run(env.engine, GenRequest(None, prompt="x" * (IDLE_LOOP_TOKENIZE_CHARS + 1), n_predict=1))
        assert tokenized_on_inference_thread()
        where.clear()
        await run(env.engine, GenRequest(None, messages=[{"role": "user", "content": "hi"}], n_predict=1))
        assert tokenized_on_loop()
        where.clear()
        many = [{"role": "user", "content": "hi"}] * (IDLE_LOOP_TOKENIZE_CHARS // 8)  # short each, long together
        with pytest.raises(BadInput, match="does not fit"):
            await run(env.engine, GenRequest(None, messages=many, n_predict=1))
        assert tokenized_on_inference_thread()
        where.clear()
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        await run(env.engine, GenRequest(None, messages=[{"role": "user", "content": "hi"}], n_predict=1,
                                         template_vars={"tools": tools}))
        assert tokenized_on_loop()  # an agent's turn on an idle engine
        where.clear()
        # what the template renders counts: the tools' definitions, an assistant's calls
        big = [{"type": "function", "function": {"name": "f", "description": "d" * IDLE_LOOP_TOKENIZE_CHARS}}]
        await run(env.engine, GenRequest(None, messages=[{"role": "user", "content": "hi"}], n_predict=1,
                                         template_vars={"tools": big}))  # (the scripted template renders no tools)
        assert tokenized_on_inference_thread()
        where.clear()
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "a" * IDLE_LOOP_TOKENIZE_CHARS}}
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "c", "content": "ok"}]
        await run(env.engine, GenRequest(None, messages=turns, n_predict=1, template_vars={"tools": tools}))
        assert tokenized_on_inference_thread()


@pytest.mark.asyncio
async def test_a_longer_input_arriving_while_a_job_runs_is_tokenized_on_the_inference_thread():
    """With a stream running, the loop that writes its tokens does not tokenize a prompt past
    the short bound: the inference thread does, between steps."""
    import threading

    from engine.stepper import LOOP_TOKENIZE_CHARS

    async with scripted_engine(n_slots=2, n_ctx_slot=1024, stepped=True) as env:
        model = env.engine.actor.model
        where: dict[str, str] = {}
        real = model.tokenize

        def tokenize(text, *args, **kwargs):
            where[text[:5]] = threading.current_thread().name
            return real(text, *args, **kwargs)

        model.tokenize = tokenize
        running = env.engine.submit(GenRequest(None, prompt="first", n_predict=8))
        await env.settled()
        assert env.held  # its first step, at the decode gate
        longer = env.engine.submit(GenRequest(None, prompt="x" * (LOOP_TOKENIZE_CHARS + 1), n_predict=1))
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        agent = env.engine.submit(GenRequest(None, messages=[{"role": "user", "content": "agent"}], n_predict=1,
                                             template_vars={"tools": tools}))
        await env.finish(running)
        await env.finish(longer)
        await env.finish(agent)
        assert where["first"] == threading.current_thread().name  # nothing ran yet: on the loop
        assert where["xxxxx"].startswith("hydra-inference")
        agent_text = [k for k in where if k not in ("first", "xxxxx")]
        assert agent_text and where[agent_text[0]].startswith("hydra-inference")  # a chat with tools: never short
