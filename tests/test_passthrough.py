"""ggml-RPC through our port with a real llama.cpp client and server (no mocks)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from codec import ggml as G
from codec.enums import Op, Status
from codec.framing import encode_request as hydra_request
from tests.ggml_helpers import recv_exact
from tests.helpers import start_server, wait_until
from tools.spawn import GgmlRpcServerProcess

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
    with GgmlRpcServerProcess() as up:
        yield up.endpoint


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


V = (7, 0, 0)


class HeldUpstream:
    """A stand-in rpc-server that holds its HELLO reply until ``release`` is set: the window in
    which a client's bytes reach our port while its session still waits for its upstream (a
    real rpc-server answers too fast to aim at it). Counts sessions; keeps what is forwarded."""

    def __init__(self):
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = "127.0.0.1:%d" % self.lsock.getsockname()[1]
        self.got_hello, self.release = threading.Event(), threading.Event()
        self.sessions = 0
        self.received = bytearray()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.lsock.accept()
            except OSError:
                return
            self.sessions += 1
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(60)
            try:
                recv_exact(conn, len(G.encode_hello_request()))
                self.got_hello.set()
                self.release.wait(60)
                conn.sendall(G.encode_hello_response(V))
                while chunk := conn.recv(1 << 16):
                    self.received += chunk
            except (OSError, AssertionError):
                pass

    def close(self) -> None:
        self.release.set()
        self.lsock.close()


def test_a_hello_sent_in_pieces_while_the_upstream_is_slow(tiny_model_path):
    """llama.cpp's client sends a frame's command byte, size and payload with separate send()s.
    The first byte decides the protocol; the rest arrives while the session still waits for its
    upstream, and must reach the relay whole however the connection changed hands meanwhile."""
    up = HeldUpstream()
    server = start_server("--model", "tiny", "--no-http", "--ggml-rpc-upstream", up.endpoint)
    try:
        hello = G.encode_hello_request()
        with socket.create_connection((server.host, server.port), timeout=30) as c:
            c.sendall(hello[:1])
            wait_until(up.got_hello.is_set, "the session's HELLO to its upstream")
            c.sendall(hello[1:])
            # a request answered on another connection after those bytes arrived: the server's
            # loop has been round since, and would have read them if it still read this socket
            with socket.create_connection((server.host, server.port), timeout=30) as h:
                h.sendall(hydra_request(Op.INFO))
                assert h.recv(1) == bytes((Status.OK,))
            up.release.set()
            assert recv_exact(c, len(G.encode_hello_response(V))) == G.encode_hello_response(V)
            req = G.encode_request(G.Cmd.GET_ALIGNMENT, G.request_layout(G.Cmd.GET_ALIGNMENT, V).build({"device": 0}))
            c.sendall(req)
            wait_until(lambda: bytes(up.received) == req, "the next request forwarded whole")
        assert up.sessions == 1
    finally:
        up.close()
        assert server.stop() == 0
