"""Every feature on every model kind the fleet runs: the generated hybrid (qwen35), MoE
(qwen35moe) and sliding-window (gemma3) models through real servers (engine.model_kinds).

Each answer is checked against the model itself: a greedy continuation computed here by
llama.cpp in a fresh context, token for token — so a state that restored "successfully" but
wrongly, or a checkpoint restored at the wrong position, fails the test.
"""
from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path

import aiohttp
import pytest

from codec.decode_v3 import encode_decode_v3
from codec.enums import Op, Status
from hydra_rpc.client import HydraClient
from tests.helpers import poll_until, serving, start_server

KINDS = ["tiny-hybrid", "tiny-moe", "tiny-swa"]
RECURRENT = {"tiny-hybrid", "tiny-moe"}
MSG = [{"role": "user", "content": "Tell me about the tiny model and its layers, in a few words please."}]
N = 8


def greedy_reference(kind: str, tokens: list[int], n: int = N) -> list[int]:
    """``n`` greedy tokens after ``tokens``, from a fresh context of ``kind`` in this process."""
    from engine.backend import BatchItem
    from engine.llama_backend.model import LoadedModel
    from engine.model_files import resolve_model
    from engine.sampling import GREEDY

    with LoadedModel(resolve_model(kind), n_ctx=1024, n_seq_max=1) as m:
        s = m.make_sampler(GREEDY)
        for at in range(0, len(tokens), m.n_batch):  # the last chunk's last token gets the logits
            m.decode([BatchItem(0, tokens[at:at + m.n_batch], at)])
        out: list[int] = []
        for _ in range(n):
            out.append(m.sample(0, s))
            m.decode([BatchItem(0, [out[-1]], len(tokens) + len(out) - 1)])
        s.free()
        return out


def chat_tokens(kind: str, messages: list[dict]) -> list[int]:
    from engine.llama_backend.model import LoadedModel
    from engine.model_files import resolve_model

    with LoadedModel(resolve_model(kind), n_ctx=256, n_seq_max=1) as m:
        return m.chat_tokens(messages)


@contextlib.asynccontextmanager
async def connected(*servers):
    """Hydra clients of ``servers``, closed however the test ends."""
    clients = [await HydraClient.connect(sp.host, sp.port) for sp in servers]
    try:
        yield clients[0] if len(clients) == 1 else clients
    finally:
        for c in clients:
            await c.close()


def frames(payload: bytes) -> list[int]:
    return [struct.unpack_from("<I", payload, i)[0] for i in range(0, len(payload), 9)]


async def greedy_decode(c: HydraClient, slot: str, n: int = N) -> tuple[list[int], dict]:
    body = {"n_predict": n, "messages": None, "stream": False, "temperature": 0}
    r = await c.request(Op.DECODE, slot, json.dumps(body).encode(), timeout=60)
    assert r.ok, r
    return frames(r.payload), r.meta


async def prompt_cache(c: HydraClient) -> dict:
    return (await c.request(Op.INFO)).meta["prompt_cache"]


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    """Two servers of one kind: A (HTTP, slot files) and B (the other end of a transfer)."""
    kind = request.param
    files = tmp_path_factory.mktemp("slots")
    a = start_server("--model", kind, "--parallel", "2", "--ctx-size", "4096", "--slot-save-path", str(files),
                     "--batch-size", "2048", "--ubatch-size", "512", "--log-level", "WARNING")  # llama-server's
    b = start_server("--model", kind, "--parallel", "2", "--ctx-size", "4096", "--no-http", "--log-level", "WARNING")
    yield kind, a, b
    for sp in (a, b):
        assert sp.stop() == 0, sp.log
        assert "Traceback" not in sp.log, sp.log


@pytest.mark.asyncio
async def test_prefill_then_decode_in_every_dialect(pair):
    kind, a, _ = pair
    prompt = chat_tokens(kind, MSG)
    want = greedy_reference(kind, prompt)
    async with connected(a) as c:
        await _every_dialect(kind, c, prompt, want)


async def _every_dialect(kind: str, c: HydraClient, prompt: list[int], want: list[int]) -> None:
    r = await c.request(Op.PREFILL, "0", json.dumps({"messages": MSG}).encode())
    assert r.ok and r.meta["n_past"] == len(prompt) and r.meta["logits_size"] == 512 * 4
    before = await prompt_cache(c)
    got, meta = await greedy_decode(c, "0")
    # the first token is sampled from the PREFILL's logits, kept with the slot: nothing is
    # decoded again, no cut-back, no checkpoint restored — on every kind
    assert got == want and meta["cache_tokens"] == len(prompt)
    after = await prompt_cache(c)
    assert after["cut_refused"] == before["cut_refused"] and after["from_checkpoint"] == before["from_checkpoint"]
    # E1: raw tokens in, then E1 DECODE (the model's own continuation once more)
    r = await c.request(Op.PREFILL, "1", struct.pack(f"<{len(prompt)}i", *prompt))
    assert r.ok and r.meta["n_past"] == len(prompt)
    r = await c.request(Op.DECODE, "1", json.dumps({"n_predict": N, "messages": MSG, "stream": False,
                                                     "temperature": 0}).encode())
    assert r.ok and frames(r.payload) == want
    # PIN: a stream of pieces ended by the close
    await c.send(Op.DECODE, "1", json.dumps({"n_predict": 4, "messages": MSG}).encode())
    head, _ = await c.read_head()
    assert head.status == Status.OK


@pytest.mark.asyncio
async def test_a_decode_whose_client_left_is_continued_without_computing_the_sequence_again(pair):
    """A DECODE cancelled mid-generation (its client closed) leaves the slot as far as it got,
    its last sampled token still to be fed: the next DECODE decodes that token and goes on —
    nothing computed again (a recurrent memory cannot give back its last token to recompute its
    logits: it was the whole sequence again), and the tokens are the model's own continuation."""
    kind, a, _ = pair
    prompt = chat_tokens(kind, MSG)
    async with connected(a) as c:
        assert (await c.request(Op.PREFILL, "1", struct.pack(f"<{len(prompt)}i", *prompt))).ok
        left = await HydraClient.connect(a.host, a.port)
        await left.send(Op.DECODE, "1", json.dumps({"n_predict": 3000, "stream": False, "temperature": 0}).encode())
        await poll_until(lambda: c.request(Op.STATE_META, "1"), lambda r: r.meta["n_past"] >= len(prompt) + 40, 60)
        await left.close()
        idle = await poll_until(lambda: c.request(Op.STATE_META, "1"), lambda r: not r.meta["is_processing"], 60)
        held = idle.meta["n_past"]  # the prompt and the tokens decoded; one more was sampled
        before = await prompt_cache(c)
        got, meta = await greedy_decode(c, "1")
        assert meta["cache_tokens"] == held, meta
        assert (await prompt_cache(c))["from_checkpoint"] == before["from_checkpoint"]
    generated = held - len(prompt) + 1
    assert got == greedy_reference(kind, prompt, generated + N)[generated:]


@pytest.mark.asyncio
async def test_state_moves_between_slots_and_servers(pair):
    kind, a, b = pair
    prompt = chat_tokens(kind, MSG)
    want = greedy_reference(kind, prompt)
    with serving("--model", "tiny", "--no-http", "--log-level", "WARNING") as other:
        async with connected(other) as co:  # a state of another kind: the plain llama model
            assert (await co.request(Op.PREFILL, "0", json.dumps({"messages": MSG}).encode())).ok
            foreign = (await co.request(Op.STATE_GET, "0")).payload
    async with connected(a, b) as (ca, cb):
        await _transfer(kind, ca, cb, prompt, want, foreign)


async def _transfer(kind: str, ca: HydraClient, cb: HydraClient, prompt: list[int], want: list[int],
                    foreign: bytes) -> None:
    assert (await ca.request(Op.PREFILL, "0", json.dumps({"messages": MSG}).encode())).ok
    g = await ca.request(Op.STATE_GET, "0")
    assert g.ok and g.meta["n_past"] == len(prompt)
    for c, slot in ((ca, "1"), (cb, "0")):
        p = await c.request(Op.STATE_PUT, slot, g.payload)
        assert p.ok and p.meta["restored"] and p.meta["n_past"] == len(prompt), p
        before = await prompt_cache(c)
        got, meta = await greedy_decode(c, slot)
        assert got == want
        if kind in RECURRENT:
            # a restored recurrent state cannot be cut back to re-decode its last token: the
            # prompt is computed again from the blob's tokens, and the reply and INFO say so
            assert meta["cache_tokens"] == 0
            assert (await prompt_cache(c))["cut_refused"] == before["cut_refused"] + 1
    # a PREFILL's blob carries the last token's logits (a P/D split's prefill node sends it):
    # the decode node samples from them — nothing is computed again, not even on a recurrent model
    blob = (await ca.request(Op.PREFILL, "0", json.dumps({"messages": MSG}).encode())).payload
    p = await cb.request(Op.STATE_PUT, "1", blob)
    assert p.ok and p.meta["logits_tail"], p
    before = await prompt_cache(cb)
    got, meta = await greedy_decode(cb, "1")
    assert got == want and meta["cache_tokens"] == len(prompt)
    assert (await prompt_cache(cb))["cut_refused"] == before["cut_refused"]
    # a state of another kind is refused cleanly, and the server goes on serving
    r = await cb.request(Op.STATE_PUT, "1", foreign)
    assert r.status in (Status.BAD_REQUEST, Status.ERROR) and "error" in r.meta, r
    assert (await cb.request(Op.PREFILL, "1", json.dumps({"messages": MSG}).encode())).ok


@pytest.mark.asyncio
async def test_merged_decode_v3_with_a_kv_segment(pair):
    kind, a, b = pair
    prompt = chat_tokens(kind, MSG)
    async with connected(a, b) as (ca, cb):
        body = await _merged(ca, cb, a.http_port)
    assert body["usage"]["completion_tokens"] == N
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the restored KV serves; a recurrent state, which cannot be cut back to re-decode the last
    # prompt token, is computed again — and the reply says so
    assert cached == 0 if kind in RECURRENT else cached == len(prompt) - 1


async def _merged(ca: HydraClient, cb: HydraClient, http_port: int) -> dict:
    pre = await cb.request(Op.PREFILL, "1", json.dumps({"messages": MSG}).encode())
    kv = pre.payload[:len(pre.payload) - pre.meta["logits_size"]]
    hdr = {"generation": {"n_predict": N, "sampling": {"temperature": 0}, "stop": [], "stream": False}}
    r = await ca.request(Op.DECODE, "1", encode_decode_v3(hdr, json.dumps(MSG).encode(), kv))
    assert r.ok and r.meta["valid"] and r.meta["n_past_after_restore"] == pre.meta["n_past"], r
    async with aiohttp.ClientSession(f"http://127.0.0.1:{http_port}") as http:
        async def fetch():
            async with http.get(f"/v1/decode/{r.meta['decode_request_id']}") as resp:
                return resp.status, await resp.json()
        _, body = await poll_until(fetch, lambda s: s[0] == 200)
    return body


@pytest.mark.asyncio
async def test_multi_turn_chat_over_http_reuses_the_slot(pair):
    """Turn 2 re-renders turn 1's answer, whose tokens differ from those generated: the slot's
    KV diverges inside its tokens, which a recurrent model cannot cut back — a checkpoint serves."""
    kind, a, _ = pair
    async with aiohttp.ClientSession(f"http://127.0.0.1:{a.http_port}") as http:
        async def chat(messages):
            body = {"messages": messages, "max_tokens": N, "temperature": 0, "slot": 0}
            async with http.post("/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        one = await chat(MSG)
        turn2 = [*MSG, {"role": "assistant", "content": "x" + one["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And then?"}]
        two = await chat(turn2)
        cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= one["usage"]["prompt_tokens"] - 4 - 1, two["usage"]
        async with http.get("/slots") as resp:
            slot0 = (await resp.json())[0]
        if kind in RECURRENT or kind == "tiny-swa":
            assert slot0["checkpoints"] and all(ck["size"] > 0 for ck in slot0["checkpoints"])
    want = greedy_reference(kind, chat_tokens(kind, turn2))
    from engine.llama_backend.model import LoadedModel
    from engine.model_files import resolve_model

    with LoadedModel(resolve_model(kind), n_ctx=256, n_seq_max=1) as m:
        assert two["choices"][0]["message"]["content"] == m.detokenize(want).decode("utf-8", "replace")
    async with connected(a) as c:
        pc = await prompt_cache(c)
    assert pc["ctx_checkpoints"] == 32 and (pc["checkpoints_restored"] >= 1 or kind not in RECURRENT)


@pytest.mark.asyncio
async def test_another_question_on_a_document_restores_the_checkpoint_one_ubatch_back(pair):
    """llama-server takes checkpoints 4 + n_ubatch and 4 tokens before a prompt's end. The next
    prompt on the same document diverges inside the question, after the later one: a recurrent
    slot restores the earlier one and computes about one ubatch again, not the document. It
    takes a checkpoint where it parted from the first (llama-server does not): a third question
    that parts there too restores it and computes only its own tokens."""
    kind, a, _ = pair
    doc = "The ferry leaves the north town at dawn and reaches the south town by noon. " * 18
    asks = [doc + f"Question: which town is {w}? Answer:" for w in ("first", "last", "nearer to the sea")]
    async with aiohttp.ClientSession(f"http://127.0.0.1:{a.http_port}") as http:
        async def complete(prompt: str) -> dict:
            body = {"prompt": prompt, "max_tokens": N, "temperature": 0, "id_slot": 1}
            async with http.post("/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        answers = [await complete(prompt) for prompt in asks]
        async with http.get("/slots") as resp:
            taken = {c["n_tokens"] for c in (await resp.json())[1]["checkpoints"]}
    from engine.host_cache import common_prefix
    from engine.llama_backend.model import LoadedModel
    from engine.model_files import resolve_model

    with LoadedModel(resolve_model(kind), n_ctx=1024, n_seq_max=1) as m:
        tokens = [m.tokenize(prompt, add_special=True) for prompt in asks]
        wants = [m.detokenize(greedy_reference(kind, t)).decode("utf-8", "replace") for t in tokens[1:]]
    n_first, n_ubatch = len(tokens[0]), 512  # server A's -ub, under its -b 2048
    assert n_first > n_ubatch + 4 + 100
    parted = common_prefix(tokens[0], tokens[1])  # where the second question parts from the first
    assert common_prefix(tokens[1], tokens[2]) >= parted  # … and the third from the second
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers[1:]]
    if kind in RECURRENT:
        assert cached[0] == n_first - 4 - n_ubatch, answers[1]["usage"]
        assert parted in taken, taken
        assert cached[1] == parted, answers[2]["usage"]
    else:  # a sliding window cuts back within the window; never less than the checkpoint
        assert cached[0] >= n_first - 4 - n_ubatch, answers[1]["usage"]
        assert cached[1] >= parted, answers[2]["usage"]
    assert [a["choices"][0]["text"] for a in answers[1:]] == wants


READ = {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


def agent_turn(i: int) -> list[dict]:
    """One step of an agent: its reasoning and tool call as the client sends it back, and the result."""
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/part_{i}.py"})}}
    return [{"role": "assistant", "content": "", "reasoning_content": f"Part {i} may parse the port.",
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": f"def parse_port_{i}(text):\n    return int(text)\n"}]


class AgentServer:
    """``chat(messages, slot)``: a greedy completion of N tokens with a tool, on that slot;
    ``metric(name)``: a value of the server's /metrics."""

    def __init__(self, http: aiohttp.ClientSession):
        self.http = http

    async def chat(self, messages: list[dict], slot: int) -> dict:
        body = {"messages": messages, "tools": [READ], "max_tokens": N, "temperature": 0, "id_slot": slot}
        async with self.http.post("/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def metric(self, name: str) -> float:
        async with self.http.get("/metrics") as resp:
            lines = (await resp.text()).splitlines()
        return next(float(line.split()[-1]) for line in lines if line.split(" ")[0] == name)


@contextlib.asynccontextmanager
async def agent_chat(kind: str, *extra: str):
    """A server of ``kind`` with Qwen 3.5's template (two slots, 8 K tokens each; ``extra``:
    more arguments), as an :class:`AgentServer`."""
    template = str(Path(__file__).parent / "templates" / "qwen35_xml.jinja")
    with serving("--model", kind, "--parallel", "2", "--ctx-size", "16384", "--batch-size", "2048",
                 "--chat-template-file", template, "--log-level", "WARNING", *extra) as sp:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{sp.http_port}") as http:
            yield AgentServer(http)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", sorted(RECURRENT))
async def test_an_agents_turns_reuse_all_but_the_last_tokens_of_the_previous_prompt(kind):
    """The fleet's traffic on its model kind: each turn sends the conversation back with the
    assistant's call re-rendered by the template (Qwen 3.5's form, a think block and tools), so
    the slot's tokens diverge where the previous answer began. The checkpoint 4 tokens before
    the previous prompt's end is where it restores, as llama-server does (both reuse the same
    count on this workload); a full computation on an empty slot gives the same answer."""
    async with agent_chat(kind) as server:
        chat = server.chat
        messages = [{"role": "system", "content": "You are a coding agent. Call one tool at a time."},
                    {"role": "user", "content": "Find where the port is parsed."}]
        answer = await chat(messages, 0)
        for i in range(3):
            messages += agent_turn(i)
            before = answer["usage"]["prompt_tokens"]
            answer = await chat(messages, 0)
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == before - 4, answer["usage"]
        fresh = await chat(messages, 1)
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert fresh["choices"][0]["message"] == answer["choices"][0]["message"]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", sorted(RECURRENT))
async def test_agents_sharing_a_slot_come_back_from_the_ram_tier_at_their_checkpoint(kind):
    """More agents than slots, as a fleet node has: each agent's turn takes the slot from the
    other. The slot's state goes to the RAM tier with its checkpoints, and the agent's next
    turn, which diverges 4 tokens before its previous prompt's end, is restored from there at
    the checkpoint (without the checkpoints only the shared system prompt was reused); the
    answer is the one a full computation on an empty slot gives."""
    async with agent_chat(kind) as server:
        await agents_take_turns(server, 2)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", sorted(RECURRENT))
async def test_agents_spilled_to_the_disk_tier_come_back_at_their_checkpoint(kind, tmp_path):
    """Five agents on one slot and a 1 MiB RAM tier, which holds two or three of their ~0.3 MiB
    conversations: the next agent's conversation is always the oldest, spilled to the disk
    tier, and it comes back from there at its checkpoint (the checkpoints are written beside
    the state)."""
    async with agent_chat(kind, "--cache-ram", "1", "--slot-save-path", str(tmp_path)) as server:
        await agents_take_turns(server, 5)
        assert await server.metric("hydra_prompt_cache_disk_spills_total") >= 5 * 2
        assert await server.metric("hydra_prompt_cache_disk_restores_total") >= 5 * 2
        assert await server.metric("hydra_prompt_cache_ram_bytes") <= 1 << 20


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", sorted(RECURRENT))
async def test_a_new_agent_starts_from_the_system_prompt_it_shares_with_the_slots_last(kind):
    """A checkpoint is taken where a chat prompt's last user turn starts, as llama-server
    takes one (engine.chat.turns): the next agent, with the same system prompt and tools but
    its own task, restores there instead of computing its whole prompt (the checkpoints
    before a prompt's end lie past where the two differ). The answer is a full computation's."""
    system = {"role": "system", "content": "You are a coding agent. Call one tool at a time."}
    first, second = ([system, {"role": "user", "content": f"Agent {a}: find where the port is parsed."}]
                     for a in (1, 2))
    async with agent_chat(kind) as server:
        async with server.http.post("/apply-template", json={"messages": second, "tools": [READ]}) as r:
            text = (await r.json())["prompt"]
        async with server.http.post("/tokenize", json={"content": text[:text.rfind("<|im_start|>user")],
                                                       "add_special": True, "parse_special": True}) as r:
            system_part = len((await r.json())["tokens"])
        await server.chat(first, 0)
        answer = await server.chat(second, 0)
        fresh = await server.chat(second, 1)
    assert 0 < system_part == answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert fresh["choices"][0]["message"] == answer["choices"][0]["message"]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", sorted(RECURRENT))
async def test_an_agents_next_turn_is_cut_where_llama_server_cuts_it(kind):
    """Qwen's template writes a tool's result in a user turn, but it is no user message: the
    turn's checkpoints are llama-server's, 4 + n_ubatch and 4 tokens before its prompt's end,
    and none where the result starts (a cut there left a chunk of a few dozen tokens, which
    llama.cpp computes token by token against the whole context). The task's own user turn,
    where the agent's first prompt was cut, keeps its checkpoint."""
    messages = [{"role": "system", "content": "You are a coding agent. Call one tool at a time."},
                {"role": "user", "content": "Find where the port is parsed."}]

    async def tokens_before_last(server: AgentServer, marker: str) -> int:
        async with server.http.post("/apply-template", json={"messages": messages, "tools": [READ]}) as r:
            text = (await r.json())["prompt"]
        async with server.http.post("/tokenize", json={"content": text[:text.rfind(marker)],
                                                       "add_special": True, "parse_special": True}) as r:
            return len((await r.json())["tokens"])

    async with agent_chat(kind) as server:
        task = await tokens_before_last(server, "<|im_start|>user")
        await server.chat(messages, 0)
        messages += agent_turn(0)
        result = await tokens_before_last(server, "<|im_start|>user")  # the tool result's turn
        end = (await server.chat(messages, 0))["usage"]["prompt_tokens"]
        async with server.http.get("/slots") as r:
            taken = {c["n_tokens"] for c in (await r.json())[0]["checkpoints"]}
    assert task < result < end - 4
    assert task in taken and end - 4 in taken and result not in taken, (task, result, end, sorted(taken))


async def agents_take_turns(server: AgentServer, n_agents: int) -> None:
    """``n_agents`` agents take three steps each, in turn on slot 0: from the second step on,
    each comes back with all but the last 4 tokens of its previous prompt cached; the last
    answer equals a full computation on an empty slot."""
    agents = [[{"role": "system", "content": "You are a coding agent. Call one tool at a time."},
               {"role": "user", "content": f"Agent {a}: find where service {a} parses its port."}]
              for a in range(n_agents)]
    before = [(await server.chat(messages, 0))["usage"]["prompt_tokens"] for messages in agents]
    for i in range(3):
        for a, messages in enumerate(agents):
            messages += agent_turn(i)
            answer = await server.chat(messages, 0)
            if i:  # from the first step on, a slot's own part is worth a save (SAVE_MIN_LOST)
                assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == before[a] - 4, (i, a)
            before[a] = answer["usage"]["prompt_tokens"]
    fresh = await server.chat(agents[-1], 1)
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert fresh["choices"][0]["message"] == answer["choices"][0]["message"]


@pytest.mark.asyncio
async def test_slot_files_save_and_restore(pair):
    kind, a, _ = pair
    prompt = chat_tokens(kind, MSG)
    async with connected(a) as c, aiohttp.ClientSession(f"http://127.0.0.1:{a.http_port}") as http:
        assert (await c.request(Op.PREFILL, "0", json.dumps({"messages": MSG}).encode())).ok
        for slot, action in ((0, "save"), (1, "restore")):
            async with http.post(f"/slots/{slot}", params={"action": action}, json={"filename": "k.bin"}) as r:
                assert r.status == 200, await r.text()
        got, _ = await greedy_decode(c, "1")
    assert got == greedy_reference(kind, prompt)


@pytest.mark.asyncio
async def test_reload_between_kinds_and_refused_states():
    """tiny → tiny-hybrid → tiny by CONFIGURE; a state of the old kind is refused by the new."""
    with serving("--model", "tiny", "--no-http", "--log-level", "WARNING") as sp:
        async with connected(sp) as c:
            await _reloads(c)


async def _reloads(c: HydraClient) -> None:
    async def reload_to(spec: str, name: str) -> None:
        r = await c.request(Op.CONFIGURE, "", json.dumps({"model": spec}).encode())
        assert r.ok and r.meta["tier"] == "T3", r
        await poll_until(lambda: c.request(Op.INFO), lambda i: i.meta["model_name"] == name
                         and not i.meta["reload"]["state"] in ("loading", "draining"))

    assert (await c.request(Op.PREFILL, "0", json.dumps({"messages": MSG}).encode())).ok
    llama_state = (await c.request(Op.STATE_GET, "0")).payload
    await reload_to("tiny-hybrid", "hydra-tiny-hybrid")
    want = greedy_reference("tiny-hybrid", chat_tokens("tiny-hybrid", MSG))
    assert (await c.request(Op.PREFILL, "0", json.dumps({"messages": MSG}).encode())).ok
    assert (await greedy_decode(c, "0"))[0] == want
    hybrid_state = (await c.request(Op.STATE_GET, "0")).payload
    r = await c.request(Op.STATE_PUT, "1", llama_state)
    assert r.status in (Status.BAD_REQUEST, Status.ERROR), r
    await reload_to("tiny", "hydra-tiny-a")
    r = await c.request(Op.STATE_PUT, "1", hybrid_state)  # the seq-state header check refuses it
    assert r.status == Status.BAD_REQUEST and r.meta["rule"].startswith("seq."), r
    assert (await c.request(Op.PREFILL, "1", json.dumps({"messages": MSG}).encode())).ok


@pytest.mark.asyncio
async def test_cache_reuse_and_context_shift_are_refused_visibly_on_a_hybrid_model():
    with serving("--model", "tiny-hybrid", "--no-http", "--parallel", "1", "--ctx-size", "96", "--cache-reuse", "4",
                 "--context-shift", "--log-level", "WARNING") as sp:
        async with connected(sp) as c:
            assert "can shift positions" in (await prompt_cache(c))["cache_reuse_refused"]
            body = {"n_predict": 500, "messages": MSG, "stream": False, "temperature": 0}
            r = await c.request(Op.DECODE, "0", json.dumps(body).encode(), timeout=60)
    assert r.ok and r.meta["stop_reason"] == "ctx_full", r.meta


@pytest.mark.asyncio
async def test_moe_options_are_applied_and_reported_in_info():
    with serving("--model", "tiny-moe", "--no-http", "--n-cpu-moe", "2", "-ot", r"blk\.3\.ffn_down_shexp=CPU",
                 "--log-level", "WARNING") as sp:
        async with connected(sp) as c:
            info = (await c.request(Op.INFO)).meta
            assert (await c.request(Op.PREFILL, "0", json.dumps({"messages": MSG}).encode())).ok
    ot = info["tensor_overrides"]
    assert [o["n_tensors"] for o in ot] == [1, 3, 3] and all(o["buffer_type"] == "CPU" for o in ot)
    assert ot[1]["tensors"] == ["blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight"]
    assert info["params"]["n_cpu_moe"] == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_t2_reload_of_each_kind(kind):
    """A context size change (T2: a new context, same weights) on every kind: the reload goes
    live, the slots start empty, and a state taken before it restores into the new context and
    continues exactly as the model does."""
    with serving("--model", kind, "--no-http", "--parallel", "2", "--ctx-size", "2048", "--log-level", "WARNING") as sp:
        async with connected(sp) as c:
            assert (await c.request(Op.PREFILL, "0", json.dumps({"messages": MSG}).encode())).ok
            old_state = (await c.request(Op.STATE_GET, "0")).payload
            before = (await c.request(Op.INFO)).meta
            r = await c.request(Op.CONFIGURE, "", json.dumps({"n_ctx": 3072}).encode())
            assert r.ok and r.meta["tier"] == "T2", r
            info = await poll_until(lambda: c.request(Op.INFO), lambda i: i.meta["reload"]["state"] == "swapped")
            assert info.meta["config_generation"] > before["config_generation"]
            assert info.meta["n_ctx_slot"] == 1536 and before["n_ctx_slot"] == 1024
            assert (await c.request(Op.STATE_META, "0")).meta["n_past"] == 0  # a new context holds no sequence
            assert (await c.request(Op.STATE_PUT, "1", old_state)).ok
            tokens, meta = await greedy_decode(c, "1")
    assert tokens == greedy_reference(kind, chat_tokens(kind, MSG))
    assert meta["config_generation"] == info.meta["config_generation"]
