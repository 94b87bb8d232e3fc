"""Test helpers for ggml-RPC: a standalone llama.cpp ggml RPC server, and a HELLO'd client socket."""
from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

from tools.spawn import GgmlRpcServerProcess

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def ggml_server(threads: int = 1, timeout: float = 30.0) -> Iterator[str]:
    """llama.cpp's ggml RPC server from the wheel (``python -m hydra_rpc.ggml.child``), one client
    at a time, in a subprocess; yields "127.0.0.1:port"."""
    with GgmlRpcServerProcess(threads, timeout=timeout) as up:
        yield up.endpoint


def recv_exact(s: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``s``; fails the test if it closes first."""
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, f"closed after {len(buf)} of {n} bytes"
        buf += chunk
    return buf
