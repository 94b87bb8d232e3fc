"""Reloads that never stop serving (T2/T3 CONFIGURE, alias swaps) through the real server."""
from __future__ import annotations

import asyncio
import json

import pytest

from codec.enums import Op, Status
from hydra_rpc.client import HydraClient
from tests.helpers import serving, start_server

USER = [{"role": "user", "content": "hello there"}]
# A generation far longer than any drain or poll here: greedy from "hi", tiny-small reaches no
# end-of-generation token in 4,000 tokens (~12 s); from USER it stops at token 342, inside a slow
# host's reload, which then swaps (a loaded run did).
ENDLESS = {"n_predict": 10**6, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "stream": False}


async def info(c: HydraClient) -> dict:
    r = await c.request(Op.INFO, "", timeout=5)
    assert r.ok
    return r.meta


async def wait_reload_settled(c: HydraClient, timeout: float = 30) -> dict:
    async with asyncio.timeout(timeout):
        while True:
            m = await info(c)
            if m["reload"]["state"] not in ("loading", "draining"):
                return m
            await asyncio.sleep(0.02)


async def long_decode(server, slot: str, n: int) -> dict:
    """A DECODE (stream:false) that takes a while; returns its meta."""
    c = await HydraClient.connect(server.host, server.port)
    try:
        body = {"n_predict": n, "messages": USER, "stream": False}
        r = await c.request(Op.DECODE, slot, json.dumps(body).encode(), timeout=120)
        assert r.ok, r
        return r.meta
    finally:
        await c.close()


async def wait_processing(c: HydraClient, slot: str) -> None:
    async with asyncio.timeout(20):
        while not (await c.request(Op.STATE_META, slot)).meta["is_processing"]:
            await asyncio.sleep(0.005)


@pytest.fixture
def small_and_b(tiny_model_b_path):
    from engine.model_files import ensure_tiny_model

    return str(ensure_tiny_model("small")), tiny_model_b_path


@pytest.mark.asyncio
async def test_t3_reload_while_decoding_serve_old(small_and_b):
    small, model_b = small_and_b
    with serving("--model", small, "--no-http", "--ctx", "8192", "--log-level", "WARNING") as server:
        c = await HydraClient.connect(server.host, server.port)
        gen0 = (await info(c))["config_generation"]
        decode = asyncio.create_task(long_decode(server, "0", 2000))
        await wait_processing(c, "0")
        r = await c.request(Op.CONFIGURE, "", json.dumps({"model_path": model_b}).encode())
        assert r.ok and r.meta["tier"] == "T3" and r.meta["deferred_keys"] == ["model_path"]
        assert r.meta["config_generation"] == gen0 + 1
        states = set()
        while not decode.done():  # INFO and META keep answering during the whole reload
            states.add((await info(c))["reload"]["state"])
            assert (await c.request(Op.STATE_META, "0", timeout=5)).ok
            await asyncio.sleep(0.01)
        meta = await decode
        assert meta["config_generation"] == gen0  # finished on the old model
        assert "draining" in states or "loading" in states
        m = await wait_reload_settled(c)
        assert m["reload"]["state"] == "swapped" and m["config_generation"] == gen0 + 1
        assert m["model_name"] == "hydra-tiny-b"
        r = await c.request(Op.PREFILL, "1", json.dumps({"messages": USER}).encode())
        assert r.ok and r.meta["config_generation"] == gen0 + 1 and r.meta["model_name"] == "hydra-tiny-b"
        await c.close()


@pytest.mark.asyncio
async def test_reject_policy_answers_busy_while_pending(small_and_b):
    small, model_b = small_and_b
    with serving("--model", small, "--no-http", "--ctx", "16384", "--reload-policy", "reject",
                 "--log-level", "WARNING") as server:
        c = await HydraClient.connect(server.host, server.port)
        busy = await HydraClient.connect(server.host, server.port)
        await busy.send(Op.DECODE, "0", json.dumps(ENDLESS).encode())  # the reload stays pending until we cancel it
        await wait_processing(c, "0")
        assert (await c.request(Op.CONFIGURE, "", json.dumps({"model_path": model_b}).encode())).ok
        r = await c.request(Op.PREFILL, "1", json.dumps({"messages": USER}).encode())
        assert r.status == Status.BUSY and r.meta["error"] == "reloading" and r.meta["retry_after_ms"] > 0
        assert (await c.request(Op.STATE_META, "1")).ok
        busy.writer.transport.abort()  # client gone → generation cancelled → drain completes
        await busy.close()
        assert (await wait_reload_settled(c))["reload"]["state"] == "swapped"
        r = await c.request(Op.PREFILL, "1", json.dumps({"messages": USER}).encode())
        assert r.ok and r.meta["model_name"] == "hydra-tiny-b"
        await c.close()


@pytest.mark.asyncio
async def test_failed_reload_leaves_serving_intact(tiny_model_path, tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x00" * 64 + b"garbage" * 100)  # a GGUF by its magic: the build fails
    with serving("--model", "tiny", "--no-http", "--log-level", "WARNING") as server:
        c = await HydraClient.connect(server.host, server.port)
        gen0 = (await info(c))["config_generation"]
        # a chat template that cannot work fails the build (it is compiled at load), not every chat after it
        for bad in ({"model_path": str(corrupt)}, {"chat_template": "x"}, {"chat_template": "{% if %}"}):
            assert (await c.request(Op.CONFIGURE, "", json.dumps(bad).encode())).ok
            m = await wait_reload_settled(c)
            assert m["reload"]["state"] == "failed" and m["reload"]["error"], m["reload"]
            assert m["config_generation"] == gen0 and m["model_name"] == "hydra-tiny-a"
            r = await c.request(Op.PREFILL, "0", json.dumps({"messages": USER}).encode())
            assert r.ok and r.meta["config_generation"] == gen0
        assert "chat template" in m["reload"]["error"]
        await c.close()


@pytest.mark.asyncio
async def test_configure_refuses_a_model_that_is_no_gguf_file(tmp_path):
    """Refused when asked (rejected_keys), not by a reload that fails later."""
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with serving("--model", "tiny", "--no-http", "--log-level", "WARNING") as server:
        c = await HydraClient.connect(server.host, server.port)
        for key, path, why in (("model", str(tmp_path / "missing.gguf"), "does not exist"),
                               ("model_path", str(text), "is not a GGUF file"),
                               ("model.path", str(tmp_path), "is a directory")):
            r = await c.request(Op.CONFIGURE, "", json.dumps({key: path, "temp": 0.5}).encode())
            assert r.ok and r.meta["success"] is True, r.meta
            assert why in r.meta["rejected_keys"]["model"], r.meta
            assert r.meta["deferred_keys"] == [] and r.meta["params_applied"] == {"sampling.temp": 0.5}
            assert (await info(c))["reload"]["state"] == "idle"
        await c.close()


@pytest.mark.asyncio
async def test_newer_configure_supersedes_pending_and_drain_timeout_drops(small_and_b):
    small, model_b = small_and_b
    server = start_server("--model", small, "--no-http", "--drain-timeout", "0.3", "--ctx", "16384",
                          "--log-level", "WARNING")
    busy = await HydraClient.connect(server.host, server.port)
    try:
        c = await HydraClient.connect(server.host, server.port)
        gen0 = (await info(c))["config_generation"]
        await busy.send(Op.DECODE, "0", json.dumps(ENDLESS).encode())  # far longer than the drain timeout
        await wait_processing(c, "0")
        assert (await c.request(Op.CONFIGURE, "", json.dumps({"model_path": model_b}).encode())).ok
        r = await c.request(Op.CONFIGURE, "", json.dumps({"n_ctx": 2048}).encode())
        assert r.ok and r.meta["tier"] == "T2"
        m = await info(c)
        assert m["reload"]["keys"] == ["n_ctx"] and m["reload"]["target"] == small  # superseded
        m = await wait_reload_settled(c)
        assert m["reload"]["state"] == "dropped" and "drain timeout" in m["reload"]["error"]
        assert m["config_generation"] == gen0
        meta = (await c.request(Op.STATE_META, "0")).meta
        assert meta["is_processing"] and meta["config_generation"] == gen0  # still on the old config
        await c.close()
    finally:
        busy.writer.transport.abort()  # the server cancels the generation
        await busy.close()
        assert server.stop() == 0, server.log


@pytest.mark.asyncio
async def test_t2_n_ctx_change_takes_effect(tiny_model_path):
    long_prompt = {"prompt": "one two three four five six seven eight nine ten " * 12}  # 386 tokens
    with serving("--model", "tiny", "--no-http", "--ctx-size", "256", "--parallel", "1", "--log-level",
                 "WARNING") as server:
        c = await HydraClient.connect(server.host, server.port)
        r = await c.request(Op.PREFILL, "0", json.dumps(long_prompt).encode())
        assert r.status == Status.BAD_REQUEST and "does not fit" in r.meta["error"]
        r = await c.request(Op.CONFIGURE, "", json.dumps({"n_ctx": 1024}).encode())
        assert r.ok and r.meta["tier"] == "T2"
        m = await wait_reload_settled(c)
        assert m["reload"]["state"] == "swapped" and m["n_ctx_slot"] == 1024
        r = await c.request(Op.PREFILL, "0", json.dumps(long_prompt).encode())
        assert r.ok and r.meta["n_past"] > 256
        await c.close()


@pytest.mark.asyncio
async def test_prefill_model_alias_swaps_and_reports_load_time(tiny_model_path, tiny_model_b_path, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))  # not a model llama.cpp can load
    with serving("--model", "tiny", "--model-alias", f"fast={tiny_model_b_path}", "--model-alias",
                 f"base={tiny_model_path}", "--model-alias", f"broken={broken}", "--no-http",
                 "--log-level", "WARNING") as server:
        c = await HydraClient.connect(server.host, server.port)
        assert sorted((await info(c))["preset_aliases"]) == ["base", "broken", "fast"]
        r = await c.request(Op.PREFILL, "0", json.dumps({"model": "fast", "messages": USER}).encode())
        assert r.ok and r.meta["model_fallback"] is False and r.meta["model_load_ms"] > 0
        assert r.meta["model_name"] == "hydra-tiny-b"
        r = await c.request(Op.PREFILL, "0", json.dumps({"model": "fast", "messages": USER}).encode())
        assert r.ok and "model_load_ms" not in r.meta  # already resident: no swap
        r = await c.request(Op.PREFILL, "0", json.dumps({"model": "nope", "messages": USER}).encode())
        assert r.ok and r.meta["model_fallback"] is True
        from codec.payloads import encode_swap_quant
        before = await info(c)
        assert before["model_name"] == "hydra-tiny-b"
        # SWAP_QUANT to the other alias: answered once the other model is live
        r = await c.request(Op.SWAP_QUANT, "", encode_swap_quant("base", ".*"), timeout=60)
        assert r.ok and r.meta["success"] is True and r.meta["swapped"] is True, r.meta
        after = await info(c)
        assert after["model_name"] == "hydra-tiny-a" and after["reload"]["state"] == "swapped", after["reload"]
        assert after["config_generation"] == r.meta["config_generation"] > before["config_generation"]
        r = await c.request(Op.PREFILL, "0", json.dumps({"messages": USER}).encode())
        assert r.ok and r.meta["model_name"] == "hydra-tiny-a"
        # the same alias again: nothing to swap, and the reply says so
        r = await c.request(Op.SWAP_QUANT, "", encode_swap_quant("base", ""), timeout=60)
        assert r.ok and r.meta["success"] is True and r.meta["swapped"] is False, r.meta
        assert (await info(c))["config_generation"] == after["config_generation"]
        # a swap whose build fails swapped nothing: ERROR, and the live model is untouched
        r = await c.request(Op.SWAP_QUANT, "", encode_swap_quant("broken", ""), timeout=60)
        assert r.status == Status.ERROR and r.meta["success"] is False and r.meta["swapped"] is False, r
        m = await wait_reload_settled(c)
        assert m["model_name"] == "hydra-tiny-a" and m["reload"]["state"] == "failed", m["reload"]
        assert (await c.request(Op.PREFILL, "0", json.dumps({"messages": USER}).encode())).ok
        await c.close()


@pytest.mark.asyncio
async def test_inplace_mode_reload(small_and_b):
    small, model_b = small_and_b
    with serving("--model", "tiny", "--no-http", "--reload-mode", "inplace", "--log-level", "WARNING") as server:
        c = await HydraClient.connect(server.host, server.port)
        assert (await info(c))["reload_mode"] == "inplace"
        assert (await c.request(Op.CONFIGURE, "", json.dumps({"model_path": model_b}).encode())).ok
        m = await wait_reload_settled(c)
        assert m["reload"]["state"] == "swapped" and m["model_name"] == "hydra-tiny-b"
        assert (await c.request(Op.PREFILL, "0", json.dumps({"messages": USER}).encode())).ok
        await c.close()


@pytest.mark.asyncio
async def test_t4_use_mmap_reload(tiny_model_path):
    """T4 keys map onto llama.cpp's model/context parameters (use_mmap → load_mode)."""
    with serving("--model", "tiny", "--no-http", "--log-level", "WARNING") as server:
        c = await HydraClient.connect(server.host, server.port)
        r = await c.request(Op.CONFIGURE, "", json.dumps({"use_mmap": False, "flash_attn": 0}).encode())
        assert r.ok and r.meta["tier"] == "T4" and sorted(r.meta["deferred_keys"]) == ["flash_attn", "use_mmap"]
        m = await wait_reload_settled(c)
        assert m["reload"]["state"] == "swapped", m["reload"]
        assert (await c.request(Op.PREFILL, "0", json.dumps({"messages": USER}).encode())).ok
        await c.close()
