"""CONFIGURE ``rpc_servers`` only for ggml RPC servers on the start-up allow-list (issue 13 item 2).

A server that answers HELLO and then closes makes llama.cpp's RPC client abort the process as
soon as a model is built on it; the HELLO probe does not protect. Such a server must never be
reached because a Hydra client named it.
"""
from __future__ import annotations

import json
import socket
import threading

import pytest

from codec.enums import Op
from engine.rpc_allow import RpcAllowList
from hydra_rpc.client import HydraClient
from tests.engine_env import scripted_engine
from tests.helpers import serving


def test_allow_list_matches_host_and_port_only():
    allow = RpcAllowList(("127.0.0.1:50052", "[::1]:7", "Gpu-Box:9"))
    assert allow.refusal(("127.0.0.1:50052",)) is None
    assert allow.refusal(("gpu-box:9", "[::1]:7")) is None
    assert allow.refusal(()) is None  # no remote layers: always fine
    reason = allow.refusal(("127.0.0.1:50052", "127.0.0.1:50053"))
    assert "127.0.0.1:50053" in reason and "50052" not in reason and "--rpc-allow" in reason
    assert RpcAllowList().refusal(("127.0.0.1:1",)) is not None
    with pytest.raises(ValueError, match="HOST:PORT"):
        RpcAllowList(("no-port",))


@pytest.mark.asyncio
async def test_configure_names_a_server_off_the_list_no_reload():
    allow = RpcAllowList(("10.0.0.1:50052",))
    async with scripted_engine(rpc_allow=allow) as env:
        eng = env.engine
        g0 = eng.generation
        out = await eng.configure({"rpc_servers": "127.0.0.1:1", "sampling.temp": 0.5})
        assert "allow-list" in out.rejected_keys["rpc_servers"]
        assert out.deferred_keys == [] and out.tier == "T1" and out.reload_ticket is None
        assert eng.generation == g0 + 1 and eng.params.rpc_servers == ()  # the T1 part still applied
        out = await eng.configure({"rpc_servers": "10.0.0.1:50052"})
        assert out.deferred_keys == ["rpc_servers"] and out.params.rpc_servers == ("10.0.0.1:50052",)


class HelloThenClose:
    """A ggml RPC 'server' that accepts, reads a little and closes: what aborts llama.cpp's client."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_client_cannot_point_the_engine_at_a_server_that_aborts_it(tiny_model_path):
    evil = HelloThenClose()
    try:
        with serving("--model", "tiny", "--no-http", "--log-level", "WARNING") as sp:
            async with await HydraClient.connect(sp.host, sp.port) as c:
                r = await c.request(Op.CONFIGURE, payload=json.dumps({"rpc_servers": f"127.0.0.1:{evil.port}"}).encode(),
                                    timeout=30)
                assert r.ok and r.meta["deferred_keys"] == [], r
                assert f"127.0.0.1:{evil.port}" in r.meta["rejected_keys"]["rpc_servers"]
                body = {"prompt": "x", "hydra_config": {"rpc_servers": [f"127.0.0.1:{evil.port}"]}}
                r = await c.request(Op.PREFILL, b"0", json.dumps(body).encode(), timeout=30)
                assert r.ok, r
                info = await c.request(Op.INFO, timeout=10)
                assert info.ok and info.meta["rpc_servers"] == [] and info.meta["reload"]["state"] == "idle", info
            assert sp.proc.poll() is None
        assert evil.connections == 0
    finally:
        evil.close()
