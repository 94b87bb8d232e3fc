"""Test helpers for ggml-RPC: a standalone llama.cpp ggml RPC server, and a HELLO'd client socket."""
from __future__ import annotations

import contextlib
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from engine.ggml_rpc_child import READY_PREFIX

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def ggml_server(threads: int = 1, timeout: float = 30.0) -> Iterator[str]:
    """llama.cpp's ggml RPC server from the wheel (``python -m engine.ggml_rpc_child``), one client
    at a time, in a subprocess; yields "127.0.0.1:port"."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, "-m", "engine.ggml_rpc_child", "--port", "0", "--threads", str(threads)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    pump = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    pump.start()
    seen: list[str] = []
    try:
        while True:
            try:
                line = lines.get(timeout=timeout)
            except queue.Empty:
                raise RuntimeError(f"the ggml RPC server did not become ready; it said {seen!r}") from None
            seen.append(line)
            m = re.match(rf"{READY_PREFIX} (\d+\.\d+\.\d+\.\d+:\d+)$", line.strip())
            if m:
                break
        yield m.group(1)
    finally:
        proc.kill()
        proc.wait(10)
        pump.join(5)
        proc.stdout.close()
