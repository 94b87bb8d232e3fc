"""The engine actor step by step on the scripted backend: generation, batching, snapshots,
cancellation, queueing and BUSY, state transfer, CONFIGURE tiers. No model, no wall clock:
in step mode a test runs the engine one step at a time (``env.step()``) and looks at the
published state while the next step is held (tests/engine_env.py).
(The same behaviours on the real model and over TCP: test_engine_opcodes, test_http_*.)"""
from __future__ import annotations

import asyncio

import numpy as np

import pytest

from engine.jobs import BadInput, EngineBusy, EngineUnavailable, GenRequest
from engine.sampling import GREEDY, SamplerParams, merge_sampling
from tests.engine_env import run, scripted_engine
from tests.scripted_backend import EOS, FIRST_BYTE, N_VOCAB


def letter(c: str) -> int:
    return FIRST_BYTE + ord(c)


@pytest.mark.asyncio
async def test_prefill_then_scripted_generation():
    async with scripted_engine() as env:
        res = await run(env.engine, GenRequest(0, prompt="hi", n_predict=5, sampling=GREEDY))
        # [BOS, h, i] is prefilled; the script then says the letter at each position: d, e, f, g, h
        assert res.text == b"defgh" and res.stop_reason == "length" and res.tokens_generated == 5
        assert res.prompt_tokens == 3 and res.cached_tokens == 0
        assert res.n_past == 7  # the last sampled token is not in the KV yet (the slot's tail)
        assert env.model.kv[0] == res.tokens and res.config_generation == env.engine.generation
        assert all(s.freed for s in env.model.samplers)


@pytest.mark.asyncio
async def test_continuation_feeds_the_tail_and_prefix_is_reused():
    async with scripted_engine() as env:
        eng = env.engine
        first = await run(eng, GenRequest(0, prompt="hi", n_predict=2))
        again = await run(eng, GenRequest(0, n_predict=2))  # no input: continue the slot's sequence
        assert again.cached_tokens == first.n_past and again.text == b"fg"
        prefix = await run(eng, GenRequest(0, prompt="hi there", n_predict=0))
        assert prefix.cached_tokens == 3 and prefix.stop_reason == "none"


@pytest.mark.asyncio
async def test_stop_reasons_eos_stop_and_context_full():
    def eos_after_4(kv: list[int]) -> int:
        return EOS if len(kv) >= 4 else letter("x")

    from tests.scripted_backend import ScriptedFactory

    async with scripted_engine(backend=ScriptedFactory(script=eos_after_4)) as env:
        res = await run(env.engine, GenRequest(0, prompt="a", n_predict=10))
        assert res.stop_reason == "eos" and res.text == b"xx"
    async with scripted_engine(n_ctx_slot=8) as env:
        res = await run(env.engine, GenRequest(0, prompt="ab", n_predict=100, stop=["ef"]))
        assert res.stop_reason == "stop" and res.text.endswith(b"ef")
        res = await run(env.engine, GenRequest(1, prompt="ab", n_predict=100))
        assert res.stop_reason == "ctx_full" and res.n_past == 7
        with pytest.raises(BadInput, match="does not fit"):
            await run(env.engine, GenRequest(1, prompt="a" * 8, n_predict=1))
        with pytest.raises(BadInput, match="out of range"):
            await run(env.engine, GenRequest(1, tokens=[1, 10**6]))


@pytest.mark.asyncio
async def test_context_shift_keeps_a_full_slot_generating():
    """--context-shift: a full slot drops the older half after the BOS (+ n_keep) and goes on,
    as llama-server does; without it the slot stops at ctx_full."""
    from dataclasses import replace

    async with scripted_engine(n_ctx_slot=8) as env:
        env.engine.actor.params = replace(env.engine.params, context_shift=True)
        res = await run(env.engine, GenRequest(0, prompt="ab", n_predict=20))
        assert res.stop_reason == "length" and res.tokens_generated == 20
        assert env.engine.snapshot(0).n_past < 8  # shifted, never past the slot's context
        kv = env.model.kv[0]
        assert kv[0] == 1 and len(kv) == env.engine.snapshot(0).n_past  # the BOS kept, positions contiguous


@pytest.mark.asyncio
async def test_two_slots_share_one_batched_decode():
    async with scripted_engine(stepped=True) as env:
        eng = env.engine
        a, b = GenRequest(0, prompt="one", n_predict=3), GenRequest(1, prompt="two", n_predict=3)
        a = eng.submit(a)
        b = eng.submit(b)
        await env.settled()  # the first step held
        assert env.held
        await env.finish(a)
        await env.finish(b)
        assert [(0, 4), (1, 4)] in env.model.batches  # both prefills in one llama_decode
        assert [(0, 1), (1, 1)] in env.model.batches  # and their decode steps too


@pytest.mark.asyncio
async def test_snapshots_answer_while_a_step_is_held():
    async with scripted_engine(stepped=True) as env:
        eng = env.engine
        job = GenRequest(0, prompt="abc", n_predict=4)
        job = eng.submit(job)
        await env.settled()
        assert env.held  # a held step
        snap = eng.snapshot(0)
        assert snap.is_processing and snap.job_id == job.id and snap.operation in ("prefill", "decode")
        assert eng.info().slots_busy == 1 and not eng.snapshot(1).is_processing
        await env.finish(job)
        assert not eng.snapshot(0).is_processing and eng.snapshot(0).job_id is None


@pytest.mark.asyncio
async def test_cancel_running_and_queued_jobs_frees_the_slot_at_the_next_step():
    async with scripted_engine(stepped=True) as env:
        eng = env.engine
        running, queued = GenRequest(0, prompt="a", n_predict=1000), GenRequest(0, prompt="b", n_predict=1)
        running = eng.submit(running)
        queued = eng.submit(queued)
        await env.settled()
        assert env.held and eng.snapshot(0).queued == 1  # one running (its first step held), one queued
        queued.cancel()
        running.cancel()
        await env.step()  # the step in flight ends: both leave with it, nothing else runs
        assert running.finished() and queued.finished() and not env.held
        res = await running.result()
        assert res.stop_reason == "cancelled" and res.tokens_generated < 1000
        with pytest.raises(asyncio.CancelledError):
            await queued.result()
        assert not eng.snapshot(0).is_processing and eng.snapshot(0).queued == 0  # slot 0 idle
        assert (await env.run(GenRequest(0, prompt="c", n_predict=1))).stop_reason == "length"


@pytest.mark.asyncio
async def test_busy_slot_queues_in_order_then_answers_busy():
    async with scripted_engine(slot_queue=2, stepped=True) as env:
        eng = env.engine
        jobs = [eng.submit(GenRequest(0, prompt=p, n_predict=1)) for p in ("a", "b", "c", "d")]
        with pytest.raises(EngineBusy, match="queue is full"):
            await jobs[3].result()
        snap = eng.snapshot(0)
        assert snap.queued == 2 and snap.job_id == jobs[0].id
        assert list(snap.queued_jobs) == [jobs[1].id, jobs[2].id]  # queued in the order they came
        results = [await env.finish(j) for j in jobs[:3]]
        assert [r.tokens[:2] for r in results] == [[1, letter(p)] for p in "abc"]  # FIFO
        with pytest.raises(BadInput, match="invalid slot"):
            eng.submit(GenRequest(7))


@pytest.mark.asyncio
async def test_a_cancelled_generation_leaves_its_last_sampled_token_to_a_continuation():
    """A cancelled job's last sampled token is not in the KV yet: it stays as the slot's tail, as
    after any other ending, and a continuation decodes just it. Dropped, the continuation had to
    decode the slot's last token again for its logits — which a recurrent memory cannot give
    back: the whole sequence was computed again (22k tokens, ~9 s, on tiny-hybrid)."""
    async with scripted_engine(stepped=True) as env:
        eng = env.engine
        env.model.recurrent = True
        job = eng.submit(GenRequest(0, prompt="hi", n_predict=1000))
        await env.step(4)
        job.cancel()
        res = await env.finish(job)
        assert res.stop_reason == "cancelled" and res.tokens_generated >= 3
        seen = len(env.model.batches)
        again = await env.run(GenRequest(0, n_predict=2))
        assert again.cached_tokens == res.n_past == len(env.model.kv[0]) - 2
        assert [n for batch in env.model.batches[seen:] for seq, n in batch if seq == 0] == [1, 1]


@pytest.mark.asyncio
async def test_a_state_put_with_its_logits_continues_without_decoding_its_last_token():
    """The C++ STATE_PUT rule: n_vocab float32 after the state are its last token's logits. A
    continuation samples its first token from them; without them that token is decoded again."""
    async with scripted_engine() as env:
        eng = env.engine
        await run(eng, GenRequest(0, prompt="hello", n_predict=0))
        out = await eng.state_get(0)
        try:
            tokens, state = out.tokens, bytes(out.state)
        finally:
            out.release()
        for tail, fed_for_three in ((np.zeros(N_VOCAB, np.float32).tobytes(), [1, 1]), (b"", [1, 1, 1])):
            assert await eng.state_put(1, tokens, state + tail) == len(state)
            seen = len(env.model.batches)
            b = await run(eng, GenRequest(1, n_predict=3))
            assert b.cached_tokens == len(tokens) - (0 if tail else 1)
            fed = [n for batch in env.model.batches[seen:] for seq, n in batch if seq == 1]
            assert fed == fed_for_three  # with logits: only the two sampled tokens after the first
            a = await run(eng, GenRequest(0, n_predict=3))
            assert a.text == b.text
            await eng.erase(0)
            await run(eng, GenRequest(0, prompt="hello", n_predict=0))
        assert env.model.given_logits == [1]
        # an erase drops the logits with the state they belonged to
        assert await eng.state_put(1, tokens, state + np.zeros(N_VOCAB, np.float32).tobytes()) == len(state)
        await eng.erase(1)
        assert (await run(eng, GenRequest(1, prompt="hello", n_predict=1))).cached_tokens == 0
        assert env.model.given_logits == [1]


@pytest.mark.asyncio
async def test_a_decode_after_a_prefill_samples_from_the_prefills_logits():
    """A PREFILL (state captured, nothing generated) leaves its last token's logits with the slot:
    the DECODE that continues it decodes only what it samples, as after a STATE_PUT with logits."""
    async with scripted_engine() as env:
        eng = env.engine
        pre = await run(eng, GenRequest(0, prompt="hello", n_predict=0, capture_state=True))
        seen = len(env.model.batches)
        dec = await run(eng, GenRequest(0, n_predict=3))
        assert dec.cached_tokens == pre.prompt_tokens and env.model.given_logits == [0]
        assert [n for batch in env.model.batches[seen:] for seq, n in batch if seq == 0] == [1, 1]
        # the logits belong to that prefill only: the next continuation decodes its tail as usual
        await run(eng, GenRequest(0, prompt="hello", n_predict=0))
        assert (await run(eng, GenRequest(0, n_predict=1))).cached_tokens == pre.prompt_tokens - 1
        assert env.model.given_logits == [0]


@pytest.mark.asyncio
async def test_state_get_put_moves_a_sequence_to_another_slot():
    async with scripted_engine() as env:
        eng = env.engine
        await run(eng, GenRequest(0, prompt="hello", n_predict=0))
        out = await eng.state_get(0)
        try:
            assert out.n_past == 6 and out.tokens == env.model.kv[0]
            assert await eng.state_put(1, out.tokens, bytes(out.state)) == len(out.state)
        finally:
            out.release()
        assert env.model.kv[1] == env.model.kv[0] and eng.snapshot(1).n_past == 6
        a = await run(eng, GenRequest(0, n_predict=3))
        b = await run(eng, GenRequest(1, n_predict=3))
        assert a.text == b.text
        with pytest.raises(ValueError, match="not a scripted state"):
            await eng.state_put(1, [1, 2], b"junk")
        assert eng.snapshot(1).n_past == 0  # a failed restore leaves the slot empty
        await eng.erase(0)
        assert eng.snapshot(0).n_past == 0 and env.model.kv[0] == []


@pytest.mark.asyncio
async def test_state_ops_refuse_a_busy_slot():
    async with scripted_engine(n_ctx_slot=4096, stepped=True) as env:
        eng = env.engine
        job = await env.long_generation(0)
        for call in (eng.state_get(0), eng.state_put(0, [1], b"")):  # an erase waits (test_engine_erase.py)
            with pytest.raises(EngineBusy, match="slot 0 is"):
                await env.call(call)  # answered between two steps
        job.cancel()
        assert (await env.finish(job)).stop_reason == "cancelled"


@pytest.mark.asyncio
async def test_configure_tiers_and_generations():
    async with scripted_engine() as env:
        eng = env.engine
        g0 = eng.generation
        out = await eng.configure({"sampling": {"temp": 0.25}, "n_predict": 7, "fit": True, "frobnicate": 1})
        assert out.tier == "T1" and out.config_generation == g0 + 1 == eng.generation
        assert out.params_applied == {"sampling.temp": 0.25, "n_predict": 7}
        assert "fit" in out.rejected_keys and out.unrecognized_keys == ["frobnicate"]
        assert eng.sampling_for({}).temperature == 0.25 and eng.default_n_predict == 7
        # a value of the wrong type or out of range is rejected with its reason, never applied
        bad = await eng.configure({"sampling.top_k": "many", "n_ctx": -4, "flash_attn": 7, "rope_scale": 0})
        assert set(bad.rejected_keys) == {"sampling.top_k", "n_ctx", "flash_attn", "rope_scale"}
        assert bad.rejected_keys["flash_attn"].startswith("flash_attn must be one of on|off|auto")
        assert bad.tier == "T1" and bad.deferred_keys == [] and bad.reload_ticket is None
        assert eng.generation == g0 + 1  # nothing applied
        same = await eng.configure({"n_ctx": 64})  # what is live already: no reload
        assert same.deferred_keys == [] and same.unchanged_keys == ["n_ctx"] and same.reload_ticket is None
        out = await eng.configure({"n_ctx": 128})
        assert out.tier == "T2" and out.deferred_keys == ["n_ctx"] and out.config_generation == g0 + 2
        assert await eng.wait_reload(out.reload_ticket) == g0 + 2
        assert eng.n_ctx_slot == 128 and env.model.params.n_ctx == 128


@pytest.mark.asyncio
async def test_an_actor_bug_fails_callers_instead_of_hanging_them(monkeypatch):
    async with scripted_engine() as env:
        eng = env.engine

        def bug(serving):
            raise RuntimeError("a bug in the scheduler")

        monkeypatch.setattr(eng.actor.scheduler, "reap_cancelled", bug)
        await eng.configure({})  # answered; the actor crashes right after
        await env.wait_for(lambda: eng.startup_stage == "failed", "the crash noticed")  # its task's end
        assert "a bug in the scheduler" in eng.startup_error and not eng.ready
        with pytest.raises(EngineUnavailable, match="not running"):
            await eng.configure({})
        with pytest.raises(EngineUnavailable):
            eng.submit(GenRequest(0, prompt="x"))


def test_sampling_merge_t1_defaults_then_request_fields():
    t1 = {"sampling.temp": 0.3, "sampling.top_k": 5, "seed": 9}
    assert merge_sampling(t1) == SamplerParams(temperature=0.3, top_k=5, seed=9)
    p = merge_sampling(t1, {"temperature": 0.9, "temp": 0.1, "top_k": 2.0, "repeat_penalty": 1.2,
                            "frequency_penalty": 0.5, "presence_penalty": -0.5, "min_p": True, "top_p": "x"})
    assert (p.temperature, p.top_k, p.penalty_repeat, p.penalty_freq, p.penalty_present) == (0.1, 2, 1.2, 0.5, -0.5)
    assert p.min_p == 0.05 and p.top_p == 0.95  # wrong types are ignored
    # what a request gives as it is (a logit bias, a count of alternatives) comes last
    p = merge_sampling(t1, {"temperature": 0.9}, logit_bias=((3, -1.0),), n_probs=2)
    assert (p.temperature, p.top_k, p.logit_bias, p.n_probs) == (0.9, 5, ((3, -1.0),), 2)
