"""Every engine opcode and dialect through the real server (tiny model)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import struct

import pytest

from codec import decode_v3 as V3
from codec.enums import Op, Status
from codec.hashing import kv_hash_str
from codec.kvblob import parse_kv_blob
from codec.payloads import decode_token_frames, encode_swap_quant
from hydra_rpc.client import HydraClient
from tests.helpers import poll_until, serving

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]


SERVER_ARGS = ("--model", "tiny", "--no-http", "--slots", "4", "--ctx", "4096", "--log-level", "WARNING")


async def prefill(c, slot: str, messages=MESSAGES, **extra):
    body = {"model": "balanced", "messages": messages, "max_tokens": 12, "temperature": 0, **extra}
    return await c.request(Op.PREFILL, slot, json.dumps(body).encode(), b"t-prefill")


async def pin_decode(server, slot: str, n: int, messages=None) -> list[bytes]:
    c = await HydraClient.connect(server.host, server.port)
    try:
        await c.send(Op.DECODE, slot, json.dumps({"n_predict": n, "messages": messages}).encode())
        hdr, meta = await c.read_head()
        assert hdr.status == Status.OK and hdr.payload_len == 0 and meta == b""
        return [p async for p in c.pin_pieces()]
    finally:
        await c.close()


@pytest.mark.asyncio
async def test_prefill_new_dialect_meta_and_blob(client):
    r = await prefill(client, "0")
    assert r.status == Status.OK, r
    m = r.meta
    for key in ("n_past", "state_size", "logits_size", "model_fallback", "kv_hash_str", "config_generation"):
        assert key in m
    assert m["model_fallback"] is True  # "balanced" is not an alias here
    assert isinstance(m["n_past"], int) and m["n_past"] > 5
    assert m["kv_hash_str"] == kv_hash_str(r.payload)
    layout = parse_kv_blob(r.payload, n_vocab=m["logits_size"] // 4, state_size=m["state_size"])
    assert layout.header.version == 3 and layout.header.n_past == m["n_past"]
    assert len(layout.header.tokens) == m["n_past"] and layout.logits_offset is not None
    meta = (await client.request(Op.STATE_META, "0")).meta
    assert meta["n_past"] == m["n_past"] and meta["is_processing"] is False


@pytest.mark.asyncio
async def test_prefill_prompt_and_prefix_reuse(client):
    r1 = await client.request(Op.PREFILL, "1", json.dumps({"prompt": "the quick brown fox"}).encode())
    r2 = await client.request(Op.PREFILL, "1", json.dumps({"prompt": "the quick brown fox jumps"}).encode())
    assert r1.ok and r2.ok
    assert r2.meta["n_past"] > r1.meta["n_past"]
    assert r2.meta["cache_tokens"] >= r1.meta["n_past"] - 1  # the common prefix was not recomputed


@pytest.mark.asyncio
async def test_pin_streaming_decode_is_greedy_and_closes(server, client):
    await prefill(client, "2")
    a = await pin_decode(server, "2", 16)
    assert len(a) == 16
    await prefill(client, "2")  # same prompt again → same greedy continuation
    b = await pin_decode(server, "2", 16)
    assert a == b
    meta = (await client.request(Op.STATE_META, "2")).meta
    assert meta["n_past"] >= 16


@pytest.mark.asyncio
async def test_json_decode_stream_false_gives_9_byte_frames(client):
    await prefill(client, "3")
    r = await client.request(Op.DECODE, "3", json.dumps({"n_predict": 5, "messages": None, "stream": False}).encode())
    assert r.ok and r.meta["tokens_generated"] == len(r.payload) // 9 > 0
    frames = decode_token_frames(r.payload)
    assert frames[-1].final and not any(f.final for f in frames[:-1])
    assert all(f.logprob <= 0 for f in frames)


@pytest.mark.asyncio
async def test_e1_sequence(client):
    """tests/e1_rpc_test.py of hydra_vortex, against this server (docs/protocol.md §6.6–§6.7, E1)."""
    r = await client.request(Op.INFO, "0", b"", "test")
    assert r.ok and "engine" in r.meta
    assert (await client.request(Op.CONFIGURE, "0", b'{"test":"value"}', "test")).ok
    r = await client.request(Op.PREFILL, "0", struct.pack("<5I", 1, 2, 3, 4, 5), "test")
    assert r.ok and r.meta["n_past"] == 5
    r = await client.request(Op.STATE_META, "0", b"", "test")
    assert r.ok and r.meta["n_past"] == 5 and "state_size" in r.meta
    r = await client.request(Op.DECODE, "0", struct.pack("<i", 10), "test")
    assert r.ok and r.meta["tokens_generated"] <= 10 and isinstance(r.payload, bytes)
    r = await client.request(Op.SET_EXPERT_MODE, "0", b"solo", "test")
    assert r.ok and r.meta == {"success": True, "mode": "solo"}


@pytest.mark.asyncio
async def test_e1_prefill_rejects_out_of_vocab_ids(client):
    r = await client.request(Op.PREFILL, "0", struct.pack("<2I", 1, 10**6))
    assert r.status == Status.BAD_REQUEST


@pytest.mark.asyncio
async def test_state_get_put_into_other_slot_continues_identically(server, client):
    assert (await prefill(client, "0", [{"role": "user", "content": "count with me"}])).ok
    g = await client.request(Op.STATE_GET, "0")
    assert g.ok and g.meta["n_past"] > 0
    layout = parse_kv_blob(g.payload, state_size=g.meta["state_size"])
    assert layout.header.version == 3 and len(layout.header.tokens) == g.meta["n_past"]
    p = await client.request(Op.STATE_PUT, "3", g.payload)
    assert p.ok and p.meta["restored"] is True and p.meta["model_match"] is True and p.meta["bytes"] > 0
    assert (await client.request(Op.STATE_META, "3")).meta["n_past"] == g.meta["n_past"]
    a = await pin_decode(server, "0", 12)
    b = await pin_decode(server, "3", 12)
    assert a == b and len(a) == 12


@pytest.mark.asyncio
async def test_state_put_rejects_garbage_state(client):
    blob = b"\x03" + struct.pack("<II", 2, 2) + struct.pack("<2i", 1, 2) + b"\x00" + b"junk" * 10
    r = await client.request(Op.STATE_PUT, "1", blob)  # the state header is checked before llama.cpp sees it
    assert r.status == Status.BAD_REQUEST and r.meta["rule"] == "seq.magic", r.meta
    assert (await client.request(Op.INFO)).ok


@pytest.mark.asyncio
async def test_configure_tiers_and_reply_shape(client):
    r = await client.request(Op.CONFIGURE, "0", json.dumps({"state_chunk_size": 1048576}).encode())
    assert r.ok and r.meta["state_chunk_size_applied"] == 1048576 and r.meta["tier"] == "T1"
    cfg = {"sampling": {"temp": 0.5, "top_k": 10}, "n_predict": 64, "fit": True, "cont_batching": True,
           "frobnicate": 1}
    r = await client.request(Op.CONFIGURE, "", json.dumps(cfg).encode())
    m = r.meta
    assert r.ok and m["success"] and m["tier"] == "T1"
    assert m["params_applied"] == {"sampling.temp": 0.5, "sampling.top_k": 10, "n_predict": 64}
    assert "fit" in m["rejected_keys"] and "frobnicate" in m["unrecognized_keys"]
    r = await client.request(Op.CONFIGURE, "", json.dumps({"sampling": {"temp": "hot"}, "top_k": 20}).encode())
    assert r.ok and r.meta["params_applied"] == {"sampling.top_k": 20}  # what is right applies,
    assert r.meta["rejected_keys"] == {"sampling.temp": "sampling.temp must be a finite number >= 0 (got 'hot')"}
    r = await client.request(Op.CONFIGURE, "", b"{broken")
    assert r.status == Status.ERROR and "invalid config_json" in r.meta["error"]
    assert (await client.request(Op.CONFIGURE, "", b"")).meta["tier"] == "T1"
    r = await client.request(Op.CONFIGURE, "", json.dumps({"sampling": {"temp": 0.0}}).encode())
    assert r.ok


@pytest.mark.asyncio
async def test_values_llama_cpp_asserts_on_are_rejected_and_the_server_lives(server, client):
    """Issue 13 items 1 and 13, against `hydra-rpc serve --model tiny`: each of these once
    aborted the process or failed inside a reload."""
    r = await client.request(Op.CONFIGURE, "", json.dumps({"flash_attn": 7, "rope_scale": 0, "n_ctx": 2**31,
                                                           "cache_type_v": "q4_2", "kv_unified": "maybe"}).encode())
    assert r.ok and set(r.meta["rejected_keys"]) == {"flash_attn", "rope_scale", "n_ctx", "cache_type_v",
                                                     "kv_unified"}
    assert r.meta["deferred_keys"] == [] and "reload" not in r.meta
    body = {"prompt": "x", "hydra_config": {"flash_attn": 2, "rope_scale": 0}}
    assert (await client.request(Op.PREFILL, "0", json.dumps(body).encode())).ok
    assert (await client.request(Op.INFO)).meta["reload"]["state"] == "idle" and server.proc.poll() is None


@pytest.mark.asyncio
async def test_expert_mode_swap_quant_pipeline(client):
    r = await client.request(Op.SET_EXPERT_MODE, "", b'{"mode":"combined","peer":"10.0.0.1:1"}')
    assert r.ok and r.meta["mode"] == "solo" and r.meta["peer_connected"] is False
    r = await client.request(Op.SET_EXPERT_MODE, "", b"turbo")
    assert r.status == Status.ERROR and r.meta["success"] is False
    r = await client.request(Op.SWAP_QUANT, "worker-1", encode_swap_quant("Q4_K_M", ".*ffn.*"))
    assert r.status == Status.NOT_IMPLEMENTED and r.meta["success"] is False
    r = await client.request(Op.PIPELINE_ATTACH, "0", b'{"peer":"127.0.0.1:1","ot_split":"x"}')
    assert r.status == Status.NOT_IMPLEMENTED and r.meta["success"] is False
    r = await client.request(Op.PIPELINE_ATTACH, "", b"{}")
    assert r.status == Status.ERROR  # numeric key required, as the C++


@pytest.mark.asyncio
async def test_csharp_request_encodings(client):
    """The exact bodies the C# RpcClient sends (docs/protocol.md §6)."""
    assert (await client.request(Op.INFO, "")).ok  # HydraEngineClient sends an empty key
    r = await client.request(Op.CONFIGURE, "0", b'{"state_chunk_size":2097152}', "startup-configure")
    assert r.ok and r.meta["state_chunk_size_applied"] == 2097152
    body = {"model": "", "messages": MESSAGES, "stream": False, "n_predict": 0,
            "hydra_config": {"n_predict": 32}}
    r = await client.request(Op.PREFILL, "1", json.dumps(body).encode())
    assert r.ok and r.meta["n_past"] > 0
    r = await client.request(Op.DECODE, "1", json.dumps({"n_predict": 4, "messages": None, "stream": False}).encode())
    assert r.ok


@pytest.mark.asyncio
async def test_merged_decode_v3_restores_kv_and_answers(client):
    pre = await prefill(client, "2")
    assert pre.ok
    info = (await client.request(Op.INFO)).meta
    ident = {k: info[k] for k in ("tokenizer", "model_name", "model_quant", "model_capabilities")}
    hdr = {"model": "", "kv_metadata": {"n_past": pre.meta["n_past"], **ident}, "model_metadata": ident,
           "generation": {"n_predict": 8, "sampling": {"temp": 0}, "stop": [], "stream": False,
                          "chat_syntax": "", "oaicompat_model": ""}}
    kv = pre.payload[:len(pre.payload) - pre.meta["logits_size"]]
    payload = V3.encode_decode_v3(hdr, json.dumps(MESSAGES).encode(), kv)
    r = await client.request(Op.DECODE, "1", payload)
    assert r.ok, r
    assert r.meta["valid"] is True and r.meta["n_past_after_restore"] == pre.meta["n_past"]
    assert r.meta["match"]["tokenizer_match"] is True and isinstance(r.meta["decode_request_id"], int)
    # wrong tokenizer → refused by Gate A
    bad = dict(hdr, kv_metadata={**hdr["kv_metadata"], "tokenizer": "gpt2/50257"})
    r = await client.request(Op.DECODE, "1", V3.encode_decode_v3(bad, json.dumps(MESSAGES).encode(), kv))
    assert r.status == Status.ERROR and r.meta["valid"] is False and r.meta["error_code"] == "CAP_MISMATCH"
    # a hash that does not match → BAD_REQUEST naming the rule, connection still in sync
    frame = bytearray(payload)
    frame[4] ^= 0xFF
    r = await client.request(Op.DECODE, "1", bytes(frame))
    assert r.status == Status.BAD_REQUEST and r.meta["rule"] == "v3.hdr_hash"
    assert (await client.request(Op.INFO)).ok


@pytest.mark.asyncio
async def test_meta_answers_while_the_same_slot_decodes(server):
    """STATE_META about a slot that is decoding: answered, and its progress advances."""
    poll = await HydraClient.connect(server.host, server.port)
    c = await HydraClient.connect(server.host, server.port)
    reader = None
    try:
        # an earlier test's job on this slot may still be winding down: its readings are not ours
        await wait_meta(poll, "1", lambda m: not m["is_processing"])
        # Generation runs until the slot's context is full (thousands of tokens), unless cancelled.
        body = {"n_predict": 100000, "messages": [{"role": "user", "content": "go"}]}
        await c.send(Op.DECODE, "1", json.dumps(body).encode())
        hdr, _ = await c.read_head()
        assert hdr.status == Status.OK
        seen = []
        reader = asyncio.create_task(_count_pieces(c))

        async def progress() -> list:
            assert not reader.done(), f"the decode ended before META showed progress: {seen}"
            m = (await poll.request(Op.STATE_META, "1", timeout=5)).meta
            if m["is_processing"] and m["operation"] == "decode":
                seen.append(m["tokens_processed"])
            return seen

        # a state, not a time: two different progress readings mid-decode
        await poll_until(progress, lambda s: len(set(s)) >= 2)
        assert seen == sorted(seen) and seen[-1] > seen[0], seen
        reader.cancel()
        c.writer.transport.abort()  # cancels the generation
        await wait_meta(poll, "1", lambda m: not m["is_processing"])
    finally:
        if reader is not None:
            reader.cancel()
        await poll.close()
        await c.close()


async def wait_meta(c: HydraClient, slot: str, done, timeout: float = 60.0) -> dict:
    """Poll STATE_META until ``done(meta)``."""
    return (await poll_until(lambda: c.request(Op.STATE_META, slot), lambda r: done(r.meta), timeout)).meta


async def _count_pieces(c: HydraClient) -> int:
    return len([p async for p in c.pin_pieces()])


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_client_disconnect_mid_decode_cancels_the_generation_and_frees_the_slot():
    """A PIN DECODE that cannot end on its own — greedy, n_predict at its maximum, a 128-token
    slot with --context-shift, so a full slot shifts and goes on — ends only when its client's
    RST cancels it. Broken cancellation leaves the slot busy and the wait for an idle slot
    fails, on any host speed and whatever the slot size."""
    with serving("--model", "tiny", "--no-http", "--parallel", "1", "--ctx-size", "128", "--context-shift",
                 "--log-level", "WARNING") as sp:
        poll = await HydraClient.connect(sp.host, sp.port)
        c = await HydraClient.connect(sp.host, sp.port)
        try:
            n_ctx_slot = (await poll.request(Op.INFO)).meta["kv_cache"]["n_ctx_slot"]
            body = {"n_predict": 2**31 - 1, "messages": [{"role": "user", "content": "x"}]}
            await c.send(Op.DECODE, "0", json.dumps(body).encode())
            hdr, _ = await c.read_head()
            assert hdr.status == Status.OK
            # More pieces than the slot holds: the context has shifted, so the generation does
            # not stop at a full context (or at an end of generation) by itself.
            pieces = 0
            async with asyncio.timeout(60), contextlib.aclosing(c.pin_pieces()) as stream:
                async for _ in stream:
                    pieces += 1
                    if pieces > n_ctx_slot:
                        break
            assert pieces > n_ctx_slot
            assert (await poll.request(Op.STATE_META, "0")).meta["is_processing"] is True
            c.writer.transport.abort()  # RST mid-stream: cancels the generation
            idle = await wait_meta(poll, "0", lambda m: not m["is_processing"], timeout=30)
            assert idle["n_past"] <= n_ctx_slot
            # the slot is free: the next job runs at once, and nothing else writes into it after
            r = await poll.request(Op.PREFILL, "0", json.dumps({"prompt": "the quick brown fox"}).encode())
            assert r.ok, r
            after = await wait_meta(poll, "0", lambda m: not m["is_processing"], timeout=30)
            assert after["n_past"] == r.meta["n_past"], (after, r.meta)
        finally:
            await poll.close()
            await c.close()
