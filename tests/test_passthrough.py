"""ggml-RPC through our port with a real llama.cpp client and server (no mocks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.ggml_helpers import ggml_server as start_ggml_server
from tests.helpers import start_server

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_client(model: str, endpoint: str | None, n: int = 16) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.join(HERE, "ggml_client.py"), model, endpoint or "-", str(n)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ggml_server():
    """llama.cpp's own ggml RPC server, started from the wheel's library in a subprocess."""
    with start_ggml_server() as endpoint:
        yield endpoint


def test_passthrough_to_upstream_matches_local(tiny_model_path, ggml_server):
    local = run_client(tiny_model_path, None)
    server = start_server("--model", "tiny", "--no-http", "--ggml-rpc-upstream", ggml_server, "--log-level", "INFO")
    try:
        remote = run_client(tiny_model_path, f"{server.host}:{server.port}")
    finally:
        assert server.stop() == 0
    assert any(d.startswith("RPC") for d in remote["devices"]), remote
    assert remote["tokens"] == local["tokens"]
    assert "ggml-RPC" in server.log  # went through the passthrough, not around it


def test_passthrough_to_embedded_server_matches_local(tiny_model_path):
    local = run_client(tiny_model_path, None)
    server = start_server("--model", "tiny", "--no-http", "--ggml-rpc-embedded")
    try:
        remote = run_client(tiny_model_path, f"{server.host}:{server.port}")
    finally:
        assert server.stop() == 0
    assert remote["tokens"] == local["tokens"]


@pytest.mark.asyncio
async def test_engine_layers_on_remote_ggml_server_match_local(tiny_model_path, ggml_server):
    """--rpc-servers: the engine's own layers live on a ggml RPC server (issue: distributed layers)."""
    from codec.enums import Op
    from hydra_rpc.client import HydraClient

    async def greedy(*extra) -> tuple[list[bytes], dict]:
        server = start_server("--model", "tiny", "--no-http", "--log-level", "WARNING", *extra)
        try:
            c = await HydraClient.connect(server.host, server.port)
            info = (await c.request(Op.INFO)).meta
            await c.request(Op.PREFILL, "0", json.dumps({"prompt": "The quick brown fox"}).encode())
            await c.send(Op.DECODE, "0", b'{"n_predict":16,"messages":null}')
            await c.read_head()
            pieces = [p async for p in c.pin_pieces()]
            await c.close()
            return pieces, info
        finally:
            assert server.stop() == 0

    local, _ = await greedy()
    remote, info = await greedy("--rpc-servers", ggml_server)
    assert info["rpc_backend_active"] is True and any(ggml_server in d for d in info["devices"])
    assert remote == local
