"""Chat completions fired while a T3 CONFIGURE reloads the model — the original bug report's
own reproduction — under each reload policy, on the real llama.cpp backend.

The load is held (no clock involved): the loader thread is a single thread, so a task queued
on it before the CONFIGURE keeps the shadow build waiting, and the reload in ``loading``,
until the test releases it.
"""
from __future__ import annotations

import json
import threading

import openai
import pytest

from codec.enums import Op, Status
from engine.config import EngineConfig
from engine.model_params import ModelParams
from hydra_rpc.app import App
from hydra_rpc.client import HydraClient
from hydra_rpc.config import ServerConfig

from tests.helpers import poll_until


async def _info(app: App) -> dict:
    async with await HydraClient.connect(*app.address) as c:
        r = await c.request(Op.INFO, b"")
    assert r.status == Status.OK
    return r.meta


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["serve-old", "reject"])
async def test_chats_during_a_reload(tiny_model_path, tiny_model_b_path, policy):
    app = App(ServerConfig(host="127.0.0.1", port=0),
              EngineConfig(model=ModelParams(tiny_model_path, n_ctx=1024, n_slots=2, n_threads=1),
                           reload_policy=policy),
              http_host="127.0.0.1", http_port=0)
    await app.start()
    release = threading.Event()
    try:
        app.engine.actor.loader.submit(release.wait, 60)  # the build queues behind this
        async with await HydraClient.connect(*app.address) as c:
            r = await c.request(Op.CONFIGURE, b"", json.dumps({"model_path": tiny_model_b_path}).encode())
        assert r.status == Status.OK and r.meta["reload"] == "loading"
        g0, target = r.meta["config_generation"] - 1, r.meta["config_generation"]
        info = await _info(app)
        assert info["reload"]["state"] == "loading" and info["config_generation"] == g0
        assert info["reload"]["progress"]["stage"] == "tensors" and info["reload"]["progress"]["model_bytes"] > 0

        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{app.http.address[1]}/v1", api_key="unused",
                                      max_retries=0, timeout=60) as client:
            for i in range(3):
                chat = client.chat.completions.create(
                    model="any", max_tokens=16, messages=[{"role": "user", "content": f"question {i}"}])
                if policy == "serve-old":
                    done = await chat
                    assert done.model_extra["config_generation"] == g0  # the old config served it
                    assert done.usage.completion_tokens > 0
                else:
                    with pytest.raises(openai.APIStatusError) as err:
                        await chat
                    assert err.value.status_code == 503
                    body = err.value.response.json()
                    assert body["error"]["message"] == "reloading" and body["retry_after_ms"] > 0
                    assert int(err.value.response.headers["Retry-After"]) >= 1
            assert (await _info(app))["reload"]["state"] == "loading"  # all of them during the load

            release.set()
            info = await poll_until(lambda: _info(app), lambda m: m["config_generation"] == target)
            assert info["reload"]["state"] == "swapped" and info["reload"]["progress"]["share"] == 1.0
            done = await client.chat.completions.create(model="any", max_tokens=4,
                                                        messages=[{"role": "user", "content": "after"}])
            assert done.model_extra["config_generation"] == target
    finally:
        release.set()
        await app.shutdown()
