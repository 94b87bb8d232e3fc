"""``hydra-rpc fuzz --protocol ggml`` through our passthrough to a real llama.cpp rpc-server."""
from __future__ import annotations

import json
import socket
import struct
import sys
import threading

import pytest

from codec import ggml as G
from tools.fuzzer.ggml_cases import SWEEP
from tests.helpers import run_fuzz as fuzz, start_server
from tools.spawn import GgmlRpcServerProcess


@pytest.fixture(scope="module")
def upstream():
    """llama.cpp's own ggml RPC server (from the wheel) in a subprocess."""
    with GgmlRpcServerProcess(1) as up:
        yield up.port


@pytest.fixture(scope="module")
def proxy(upstream, tiny_model_path):
    sp = start_server("--model", "tiny", "--no-http", "--log-level", "WARNING",
                      "--ggml-rpc-upstream", f"127.0.0.1:{upstream}")
    yield sp
    sp.stop()


def test_ggml_mode_needs_explicit_consent():
    p = fuzz("--protocol", "ggml", "--target", "127.0.0.1:1", "--cases", "1")
    assert p.returncode == 2 and "--i-know-upstream-may-crash" in p.stderr


def test_remote_targets_need_allow_remote():
    p = fuzz("--target", "192.0.2.1:9503", "--cases", "1")
    assert p.returncode != 0 and "--allow-remote" in p.stderr


def test_handshake_and_framing_cases_keep_proxy_and_upstream_alive(proxy, upstream, tmp_path):
    p = fuzz("--protocol", "ggml", "--i-know-upstream-may-crash", "--target", f"{proxy.host}:{proxy.port}",
             "--cases", "30", "--seed", "1", "--out", str(tmp_path), "--json", "--no-minimize")
    assert p.returncode == 0, p.stdout + p.stderr
    results = json.loads(p.stdout)
    assert results["cases"] == 30 and not results["stopped_early"] and not results["findings"]


def test_the_whole_sweep_against_the_embedded_server(tmp_path):
    """Every case that has crashed llama.cpp's rpc-server, against --ggml-rpc-embedded: the Hydra
    port keeps answering (the oracle), nothing else fails, and the guard stops each crash before
    the child (no child died)."""
    n = len(SWEEP)
    spawn = f"{sys.executable} -m hydra_rpc.cli serve --model tiny --no-http --port {{port}} --ggml-rpc-embedded"
    p = fuzz("--protocol", "ggml", "--i-know-upstream-may-crash", "--target", "127.0.0.1:0", "--spawn", spawn,
             "--cases", str(n), "--seed", "1", "--out", str(tmp_path), "--json", "--no-minimize")
    assert p.returncode == 0, p.stdout + p.stderr
    results = json.loads(p.stdout)
    assert results["cases"] == n and not results["findings"] and not results["restarts"]
    assert results["notes"].get("ggml child died", 0) == 0, (tmp_path / "target.log").read_text()[-3000:]
    log = (tmp_path / "target.log").read_text()
    assert log.count("closed ggml-RPC client") >= len([c for c in SWEEP if c[0] == "buffer"]) - 1


@pytest.fixture
def slow_upstream():
    """A stand-in rpc-server that answers a command only once the client's half-close has reached
    it: the order that lost the reply, made certain (the real rpc-server loses that race too, just
    less often). The session's own HELLO (the passthrough's) is answered at once."""
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    hello_len = len(G.encode_hello_request())

    def serve() -> None:
        with lsock:
            while True:
                try:
                    conn, _ = lsock.accept()
                except OSError:
                    return
                with conn:
                    try:
                        hello = b""
                        while len(hello) < hello_len and (chunk := conn.recv(hello_len - len(hello))):
                            hello += chunk
                        conn.sendall(G.encode_hello_response((7, 0, 0)))
                        while conn.recv(4096):  # the GET_ALIGNMENT, then the forwarded half-close
                            pass
                        conn.sendall(G.encode_response(struct.pack("<Q", 32)))
                    except OSError:
                        pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield port
    lsock.close()
    t.join(5)


# Regression (fixed): found by `hydra-rpc fuzz --protocol ggml` (desync:dropped-reply) — replies lost after a client half-close.
def test_passthrough_delivers_replies_after_a_client_half_close(slow_upstream, tiny_model_path):
    sp = start_server("--model", "tiny", "--no-http", "--log-level", "WARNING",
                      "--ggml-rpc-upstream", f"127.0.0.1:{slow_upstream}")
    try:
        with socket.create_connection((sp.host, sp.port), timeout=10) as s:
            s.sendall(G.encode_hello_request() + G.encode_request(G.Cmd.GET_ALIGNMENT, struct.pack("<I", 0)))
            s.shutdown(socket.SHUT_WR)  # "that was my last request"; the replies are still owed
            data = b""
            while chunk := s.recv(4096):
                data += chunk
    finally:
        sp.stop()
    assert len(data) == (8 + 28) + (8 + 8), data.hex()  # our HELLO reply, then the upstream's alignment
    assert data[-8:] == struct.pack("<Q", 32)
