"""ggml RPC through the wheel's libraries (engine/ggml_rpc_lib.py).

Registering a server is process-global and irreversible, so every test that registers one
runs the client in a subprocess. The test process itself only lists devices.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import ggml_rpc_lib as rpc
from engine.llama_backend import BatchItem, LoadedModel, SamplerParams, make_sampler
from tools.spawn import GgmlRpcServerProcess, child_env

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox jumps over the lazy dog."
N_GEN = 16


def _run_py(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)


def _result(r: subprocess.CompletedProcess[str], out: Path) -> dict:
    """The child's JSON result, written to a file (llama.cpp's RPC server printf()s to stdout)."""
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return json.loads(out.read_text())


def _greedy_local(model_path: str, n_gpu_layers: int = 0) -> list[int]:
    with LoadedModel(model_path, n_ctx=512, n_seq_max=1, n_gpu_layers=n_gpu_layers,
                     n_threads=1) as m:
        s = make_sampler(SamplerParams(temperature=0.0), m)
        p = m.tokenize(PROMPT)
        m.decode([BatchItem(0, p, 0)])
        pos, out = len(p), []
        for _ in range(N_GEN):
            t = s.sample(m, 0)
            out.append(t)
            m.decode([BatchItem(0, [t], pos)])
            pos += 1
        s.free()
        return out


# the client side, run in a fresh interpreter: register, list, load with offload, generate
CLIENT = """
import json, pathlib, sys, time
from engine import ggml_rpc_lib as rpc
from engine.llama_backend import set_llama_logging
sys.path.insert(0, {tests!r})
from test_ggml_rpc_lib import _greedy_local
dead = "127.0.0.1:%d" % rpc.find_free_port()
try:
    rpc.register_rpc_server(dead)
    dead_err = None
except ConnectionError as e:
    dead_err = str(e)
t = time.perf_counter()
name = rpc.register_rpc_server({endpoint!r})
reg_ms = (time.perf_counter() - t) * 1e3
again = rpc.register_rpc_server({endpoint!r})
set_llama_logging(True)  # to stderr: the test checks that the weights went to the RPC device
tokens = _greedy_local({model!r}, n_gpu_layers=99)
result = {{"name": name, "again": again, "devices": rpc.list_devices(), "tokens": tokens,
          "dead_err": dead_err, "reg_ms": reg_ms, "registered": rpc.registered_servers()}}
pathlib.Path({out!r}).write_text(json.dumps(result))
"""


@pytest.fixture
def rpc_server() -> Iterator[str]:
    """llama.cpp's ggml RPC server (CPU) in a subprocess; yields "host:port"."""
    with GgmlRpcServerProcess(threads=1) as up:
        yield up.endpoint


def test_list_devices_has_cpu() -> None:
    devs = rpc.list_devices()
    assert any(d["type"] == "CPU" for d in devs)
    assert all(set(d) == {"name", "description", "type"} for d in devs)
    assert rpc.registered_servers() == {}  # the test process never registers anything


def test_uses_the_libggml_that_libllama_links() -> None:
    assert os.path.basename(rpc.libggml()._name) == "libggml.so.0"


def test_find_free_port() -> None:
    p = rpc.find_free_port()
    assert 0 < p < 65536


def test_client_proto_version() -> None:
    assert rpc.client_proto_version() == (7, 0, 0)  # llama-cpp-python 0.3.36


def test_probe_refused_and_garbage() -> None:
    import socket

    with pytest.raises(ConnectionError, match="unreachable"):
        rpc.probe_rpc_server(f"127.0.0.1:{rpc.find_free_port()}", timeout=2)
    with pytest.raises(ValueError):
        rpc.probe_rpc_server("no-port-here")
    # something that is not a ggml RPC server: answers with junk and closes
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def answer() -> None:
        c, _ = srv.accept()
        with c:
            c.recv(64)
            c.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        with pytest.raises(ConnectionError):
            rpc.probe_rpc_server(f"127.0.0.1:{srv.getsockname()[1]}", timeout=2)
    finally:
        t.join(timeout=5)
        srv.close()


def test_rpc_offload_end_to_end(rpc_server: str, tiny_model_path: str, tmp_path: Path) -> None:
    local = _greedy_local(tiny_model_path)
    assert rpc.probe_rpc_server(rpc_server) == (7, 0, 0)  # HELLO only: no registration
    out = tmp_path / "result.json"
    r = _run_py(CLIENT.format(tests=str(ROOT / "tests"), endpoint=rpc_server, model=tiny_model_path, out=str(out)))
    res = _result(r, out)
    assert res["name"].startswith("RPC") and res["again"] == res["name"]
    assert res["registered"] == {rpc_server: res["name"]}
    rpc_devs = [d for d in res["devices"] if d["name"].startswith("RPC")]
    assert rpc_devs and rpc_devs[0]["description"] == rpc_server
    assert res["dead_err"] and "unreachable" in res["dead_err"]
    # the weights really live on the RPC device
    assert f"{res['name']}[{rpc_server}] model buffer size" in r.stderr
    assert f"layer   0 assigned to device {res['name']}" in r.stderr
    assert res["tokens"] == local
