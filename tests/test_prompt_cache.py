"""The prompt cache step by step on the scripted backend: the slot's own prefix, prefixes
shared across slots, chunks shifted into place (--cache-reuse), the RAM tier, sliding
windows, reloads, and --no-cache-prompt. The scripted model's next token depends on every
token in the KV, and a decode that would attend to a missing cell fails: a wrong reuse
shows as a different continuation or an error. (The same on the real model:
test_prompt_cache_llama.)"""
from __future__ import annotations

import pytest

from engine.jobs import GenRequest
from engine.model_params import ModelParams
from engine.sampling import GREEDY
from tests.engine_env import run, scripted_engine
from tests.scripted_backend import FIRST_BYTE, HOLE, ScriptedFactory

SYSTEM = "You are a terse assistant. " * 2  # 54 bytes: 55 tokens with BOS


def checksum(kv: list[int]) -> int:
    """Next token: a letter that depends on every token in the KV and on its length."""
    return FIRST_BYTE + ord("a") + (sum(t * (i + 1) for i, t in enumerate(kv) if t != HOLE) + len(kv)) % 26


def factory(**kw) -> ScriptedFactory:
    return ScriptedFactory(script=checksum, **kw)


async def gen(engine, slot, prompt, n=6):
    return await run(engine, GenRequest(slot, prompt=prompt, n_predict=n, sampling=GREEDY))


def params(n_slots: int = 2, **kw) -> ModelParams:
    """The prompt cache's settings (cache_prompt, cache_reuse) are the model's, as CONFIGURE sets them."""
    return ModelParams("model-a", n_ctx=256, n_slots=n_slots, n_batch=32, **kw)


def one_slot(**cfg):
    return scripted_engine(n_slots=1, n_ctx_slot=256, backend=factory(), **cfg)


async def replaced(engine, prompt):
    """``prompt`` runs on slot 0, then another conversation takes the slot."""
    first = await gen(engine, 0, prompt)
    await gen(engine, 0, "another conversation entirely, long enough to count")
    return first


@pytest.mark.asyncio
async def test_second_slot_copies_the_shared_system_prompt():
    async with scripted_engine(n_ctx_slot=256, backend=factory()) as env:
        eng = env.engine
        await gen(eng, 0, SYSTEM + "Ann: hi")
        res = await gen(eng, 1, SYSTEM + "Bob: hello")
        assert res.cached_tokens == len(SYSTEM) + 1  # BOS + the system prompt, from slot 0
        assert eng.actor.cache.stats.from_shared == 1
    async with scripted_engine(backend=factory(), model=params(cache_prompt=False)) as env:
        uncached = await gen(env.engine, 1, SYSTEM + "Bob: hello")
        assert uncached.cached_tokens == 0
    assert res.text == uncached.text and res.tokens == uncached.tokens


@pytest.mark.asyncio
async def test_no_sharing_without_a_unified_kv_or_past_a_sliding_window():
    async with scripted_engine(n_ctx_slot=256, backend=factory(kv_shareable=False)) as env:
        await gen(env.engine, 0, SYSTEM + "a")
        assert (await gen(env.engine, 1, SYSTEM + "b")).cached_tokens == 0
    # a window of 16: slot 0 has moved past the system prompt's last 16 cells, so copying
    # its prefix would leave the new tokens attending to cells that are gone
    async with scripted_engine(n_ctx_slot=256, backend=factory(n_swa=16)) as env:
        await gen(env.engine, 0, SYSTEM + "user one: a long first question", n=20)
        res = await gen(env.engine, 1, SYSTEM + "user two: b")
        assert res.cached_tokens == 0 and res.stop_reason == "length"
        # its own prefix likewise: the slot forgot what the new prompt would keep
        res = await gen(env.engine, 0, SYSTEM + "user three")
        assert res.cached_tokens == 0 and res.stop_reason == "length"
        # a continuation needs only the window: it is kept
        res = await run(env.engine, GenRequest(0, n_predict=3))
        assert res.cached_tokens == res.prompt_tokens - 1


@pytest.mark.asyncio
async def test_cache_reuse_shifts_matching_chunks_into_place():
    head, middle, tail = "system: be brief\n", "assistant: an old turn to drop\n", "user: the question that stays\n"
    async with scripted_engine(backend=factory(), model=params(cache_reuse=8)) as env:
        eng = env.engine
        await gen(eng, 0, head + middle + tail, n=1)
        res = await gen(eng, 0, head + tail + "more")
        assert res.cached_tokens == 1 + len(head) + len(tail)  # the tail chunk moved up, not recomputed
        assert eng.actor.cache.stats.chunks_shifted == 1
        assert env.model.kv[0][:res.prompt_tokens] == env.model.tokenize(head + tail + "more")
    async with scripted_engine(n_ctx_slot=256, backend=factory()) as env:  # cache_reuse off
        await gen(env.engine, 0, head + middle + tail, n=1)
        plain = await gen(env.engine, 0, head + tail + "more")
        assert plain.cached_tokens == 1 + len(head)
    assert plain.text == res.text


@pytest.mark.asyncio
async def test_no_cache_prompt_recomputes_prompts_but_continues_sessions():
    async with scripted_engine(backend=factory(), model=params(cache_prompt=False)) as env:
        eng = env.engine
        first = await gen(eng, 0, SYSTEM + "q")
        again = await gen(eng, 0, SYSTEM + "q")
        assert again.cached_tokens == 0 and again.text == first.text
        await gen(eng, 1, SYSTEM + "q")
        assert eng.actor.cache.stats.hits == 0 and eng.actor.cache.host.stats.saves == 0  # the RAM tier is not used
        cont = await run(eng, GenRequest(0, n_predict=2))  # a DECODE continues the slot's KV
        assert cont.cached_tokens == again.n_past


@pytest.mark.asyncio
async def test_a_replaced_conversation_comes_back_from_the_ram_tier():
    async with one_slot() as env:
        eng = env.engine
        conv_a = SYSTEM + "user A: tell me about cats\n"
        first_a = await replaced(eng, conv_a)
        turn_a = conv_a + first_a.text.decode() + "\nuser A: and dogs?\n"
        assert len(eng.actor.cache.host) == 1 and eng.actor.cache.stats.from_host == 0
        back = await gen(eng, 0, turn_a)
        assert back.cached_tokens == first_a.n_past  # all of A's KV, loaded back
        assert eng.actor.cache.stats.from_host == 1 and eng.actor.cache.host.stats.restores == 1
        assert len(eng.actor.cache.host) == 1  # the other conversation took A's place there
    async with one_slot(cache_ram_mib=0) as env:
        await replaced(env.engine, conv_a)
        cold = await gen(env.engine, 0, turn_a)
        assert cold.cached_tokens == 1  # only the BOS
    assert back.text == cold.text


@pytest.mark.asyncio
async def test_a_slot_that_keeps_most_of_its_tokens_saves_nothing_to_the_ram_tier():
    """llama-server's rule: the slot's state goes to the RAM tier only when a prompt keeps less
    than half of it — not for every new question on the same document."""
    async with one_slot() as env:
        eng = env.engine
        doc = SYSTEM * 3 + "The document ends here.\n"
        for i in range(4):  # each question loses the previous one's ~30 tokens, keeps the document
            await gen(eng, 0, doc + f"Question {i}: which of the lines above is the longest one?", n=2)
        host = eng.actor.cache.host
        assert host.stats.saves == 0 and len(host) == 0
        await gen(eng, 0, "another conversation entirely, long enough to count", n=2)  # keeps < half
        assert host.stats.saves == 1 and len(host) == 1


@pytest.mark.asyncio
async def test_a_question_cut_back_to_a_checkpoint_saves_nothing_when_its_own_part_is_short():
    """A memory that cannot be cut back (here a window cache; a recurrent state alike) goes back
    to a checkpoint n_ubatch tokens before the last prompt's end: ~130 tokens go, but all but
    the last question's few come back in the new prompt. Like llama-server, nothing is saved
    (on a large hybrid each save copied tens of MB). A conversation whose own part is long is
    still saved."""
    model = ModelParams("model-a", n_ctx=512, n_slots=1, n_batch=128)  # checkpoints 128 and 4 before the end
    async with scripted_engine(n_slots=1, n_ctx_slot=512, model=model,
                               backend=factory(n_swa=48, kv_shareable=False)) as env:
        eng = env.engine
        cache, host = eng.actor.cache, eng.actor.cache.host
        doc = ("Line one of a document that every question shares. " * 6)[:280]
        for i in range(3):
            await gen(eng, 0, doc + f"Question {i}: which line?", n=2)
        assert cache.checkpoints.restored == 2 and host.stats.saves == 0
        await gen(eng, 0, doc + "Question 9: " + "x" * 100, n=2)
        await gen(eng, 0, doc + "Question 10: which line?", n=2)  # the 100 own tokens go
        assert cache.checkpoints.restored == 4 and host.stats.saves == 1


@pytest.mark.asyncio
async def test_half_the_slot_shared_saves_nothing_even_where_a_checkpoint_keeps_less():
    """llama-server's ``f_keep`` is the common prefix over the slot's tokens: a short completion
    after one that began alike shares half of the slot (the prompt, not its answer) and saves
    nothing, though a memory that cannot be cut back (a window cache here; a recurrent state
    alike) goes back to a checkpoint 4 tokens before the last prompt's end, below half. On the
    fleet's model each such save copied ~63 MB out."""
    model = ModelParams("model-a", n_ctx=512, n_slots=1, n_batch=128)
    async with scripted_engine(n_slots=1, n_ctx_slot=512, model=model,
                               backend=factory(n_swa=8, kv_shareable=False)) as env:
        eng = env.engine
        cache, host = eng.actor.cache, eng.actor.cache.host
        first = "A list of lakes, number 500, with the towns on their shores:"
        await gen(eng, 0, first, n=len(first) - 4)
        held, shared = len(eng.actor.slots[0].tokens), 1 + len(first) - 3  # the BOS, all but 3 characters
        assert 2 * (shared - 2) < held <= 2 * shared  # the checkpoint's length below half, the shared part not
        await gen(eng, 0, first[:-3] + "s: Erie", n=2)
        assert cache.checkpoints.restored == 1 and host.stats.saves == 0
        await gen(eng, 0, "another conversation entirely, long enough to count", n=2)  # shares nothing
        assert host.stats.saves == 1


@pytest.mark.asyncio
async def test_a_conversation_comes_back_from_the_ram_tier_at_a_checkpoint_it_took_along():
    """Agents taking turns on one slot: the slot's state goes to the RAM tier with its two newest
    checkpoints, and the conversation's next prompt, which differs from the last one 4 tokens
    before its end (a template re-rendering the last turn), is restored at the checkpoint there
    instead of recomputed (a window cache here; a recurrent state alike). Same continuation as
    a cold computation."""
    from engine.prompt_cache import ENTRY_CHECKPOINTS

    model = ModelParams("model-a", n_ctx=512, n_slots=1, n_batch=128)  # checkpoints 128 and 4 before the end

    def engine(**cfg):
        return scripted_engine(n_slots=1, n_ctx_slot=512, model=model,
                               backend=factory(n_swa=48, kv_shareable=False), **cfg)

    first = ("Agent A reads part one of the file and reports. " * 4)[:190] + "abcd"
    async with engine() as env:
        eng = env.engine
        cache, host = eng.actor.cache, eng.actor.cache.host
        reply = (await gen(eng, 0, first, n=2)).text.decode()
        last = first + reply + " then part two of the file, which it also reads." + "wxyz"
        await gen(eng, 0, last, n=2)  # more checkpoints than go with a saved state
        taken = [c.n for c in cache.checkpoints.per_slot[0]]
        assert len(taken) > ENTRY_CHECKPOINTS and taken[-1] == 1 + len(last) - 4
        await gen(eng, 0, "Agent B works on another file entirely, long enough to count.", n=2)
        (entry,) = host.entries.values()
        assert [c.n for c in entry.checkpoints] == taken[-ENTRY_CHECKPOINTS:]
        turn = last[:-4] + "QQQQ: the port is parsed in part two."
        back = await gen(eng, 0, turn)
        assert back.cached_tokens == 1 + len(last) - 4  # the BOS and all but the last 4 tokens
        assert cache.stats.from_host == 1 and cache.checkpoints.restored >= 1
    async with engine(cache_ram_mib=0) as env:
        cold = await gen(env.engine, 0, turn)
        assert cold.cached_tokens == 0
    assert back.text == cold.text


@pytest.mark.asyncio
async def test_ram_tier_entries_never_outlive_their_model():
    async with one_slot() as env:
        eng = env.engine
        conv_a = SYSTEM + "user A: cats"
        await replaced(eng, conv_a)
        assert len(eng.actor.cache.host) == 1
        out = await eng.configure({"model_path": "b"})
        await eng.wait_reload(out.reload_ticket)
        assert len(eng.actor.cache.host) == 0 and eng.actor.cache.host.stats.invalidated == 1
        back = await gen(eng, 0, conv_a + " and dogs")
        assert back.cached_tokens == 0 and eng.actor.cache.stats.from_host == 0


@pytest.mark.asyncio
async def test_ram_tier_is_bounded_and_evicts_the_oldest():
    async with one_slot() as env:
        eng = env.engine
        eng.actor.cache.host.limit_bytes = 3 * (16 + 4 * 70) + 4 * 70  # room for about three 70-token conversations
        for i in range(6):
            await gen(eng, 0, f"conversation {i}: " + "x" * 50, n=1)
        host = eng.actor.cache.host
        assert 0 < len(host) <= 4 and host.n_bytes <= host.limit_bytes and host.stats.evictions >= 1
        oldest = await gen(eng, 0, "conversation 0: " + "x" * 50 + " again")
        assert oldest.cached_tokens < 16  # evicted: recomputed


@pytest.mark.asyncio
async def test_ram_tier_evictions_spill_to_the_disk_tier(tmp_path):
    async with one_slot(slot_save_path=str(tmp_path)) as env:
        eng = env.engine
        host = eng.actor.cache.host
        host.limit_bytes = 2 * (16 + 8 * 160)  # two conversations (state + tokens) in RAM, and on disk
        # each loses ~100 tokens to the next (a save), past the system prompt they share
        convs = [SYSTEM + f"user {c}: " + f"tell me everything you know about {c}, please. " * 2 for c in "ABC"]
        firsts = [await gen(eng, 0, c) for c in convs]
        await gen(eng, 0, "another conversation entirely, long enough to count")
        assert host.stats.spilled >= 1 and len(host.spilled) >= 1
        files = list(host.disk.dir.iterdir())
        assert len(files) == len(host.spilled) and host.disk.dir.parent == tmp_path
        back = await gen(eng, 0, convs[0] + firsts[0].text.decode())  # A: the oldest, spilled to disk
        assert back.cached_tokens == firsts[0].n_past and not files[0].exists()
        out = await eng.configure({"model_path": "b"})
        await eng.wait_reload(out.reload_ticket)
        assert not host.spilled and not list(host.disk.dir.iterdir()) and eng.actor.cache.info().disk_bytes == 0
        private = host.disk.dir
    assert not private.exists() and list(tmp_path.iterdir()) == []  # the engine stopped: nothing left
    async with one_slot(cache_ram_mib=0) as env:
        cold = await gen(env.engine, 0, convs[0] + firsts[0].text.decode())
    assert back.text == cold.text


@pytest.mark.parametrize("unified,n_swa,swa_full,shareable", [
    (True, 0, False, True),  # a full-attention model: copies are cells shared for good
    (True, 512, False, False),  # Gemma 3's window cache: shared cells would never be taken back
    (True, 512, True, True),  # --swa-full: the window cache is full size
    (False, 0, False, False),  # separate KV streams: no partial copy at all
])
def test_which_llama_contexts_share_prefixes_across_slots(unified, n_swa, swa_full, shareable):
    """llama.cpp reuses a cell that left the sliding window only while a single sequence holds
    it; prefixes copied across slots filled Gemma 3's window cache until a decode found no cell
    (the prompt-cache bench, four conversations on two slots: HTTP 500)."""
    from types import SimpleNamespace

    from engine.llama_backend import LoadedModel

    m = SimpleNamespace(cparams=SimpleNamespace(kv_unified=unified, swa_full=swa_full), n_swa=n_swa)
    assert LoadedModel.kv_shareable.fget(m) is shareable


class _Positions:
    """What prefix_intact asks of a model: a sequence's positions, and whether pos_min was asked."""

    def __init__(self, pos_min: int, pos_max: int, recurrent: bool = False, n_swa: int = 0):
        self.pos_min, self.pos_max, self.recurrent, self.n_swa = pos_min, pos_max, recurrent, n_swa
        self.asked_min = False

    def seq_pos_max(self, seq: int) -> int:
        return self.pos_max

    def seq_pos_min(self, seq: int) -> int:
        self.asked_min = True
        return self.pos_min


@pytest.mark.parametrize("model, n, intact", [
    (_Positions(0, 9), 10, True), (_Positions(0, 9), 5, True), (_Positions(0, 4), 10, False),
    (_Positions(-1, -1), 1, False), (_Positions(3, 9), 10, False),  # full attention needs every cell
    (_Positions(3, 9, n_swa=4), 10, True), (_Positions(3, 9, n_swa=4), 5, False),  # a window from n - n_swa + 1
    (_Positions(0, 9, recurrent=True), 10, True),  # a recurrent state serves exactly what it holds
    (_Positions(0, 9, recurrent=True), 5, False), (_Positions(-1, -1, recurrent=True), 3, False),
])
def test_a_prefix_is_intact_where_its_cells_are_all_there(model, n, intact):
    from engine.prompt_cache import prefix_intact

    assert prefix_intact(model, 0, n) is intact
    assert prefix_intact(model, 0, 0) is True
    if model.recurrent:  # pos_min walks every cell in llama.cpp: not asked when pos_max decides
        assert not model.asked_min
