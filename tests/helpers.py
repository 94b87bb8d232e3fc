"""Test helpers: a real server process on 127.0.0.1 and small client utilities."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    host: str
    port: int
    http_port: int | None
    lines: list[str] = field(default_factory=list)

    pump: threading.Thread | None = None

    def stop(self, sig: int = signal.SIGINT, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.pump is not None:
            self.pump.join(5)
        self.proc.stdout.close()
        return self.proc.returncode

    @property
    def log(self) -> str:
        return "".join(self.lines)


def start_server(*args: str, timeout: float = 60.0, env: dict | None = None) -> ServerProcess:
    """Start ``hydra-rpc serve ARGS --port 0`` and wait until it prints its address."""
    cmd = [sys.executable, "-m", "hydra_rpc.cli", "serve", "--port", "0", *args]
    if "--no-http" not in args and "--http-port" not in args:
        cmd += ["--http-port", "0"]
    e = dict(os.environ)
    e.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e)
    lines: list[str] = []
    port = http = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.match(r"hydra-rpc listening on ([\d.]+):(\d+)", line)
        if m:
            port = int(m.group(2))
            if "--no-http" in args:
                break
        m = re.match(r"hydra-rpc http on ([\d.]+):(\d+)", line)
        if m:
            http = int(m.group(2))
            break
    if port is None:
        proc.kill()
        raise RuntimeError("server did not start:\n" + "".join(lines))
    sp = ServerProcess(proc, "127.0.0.1", port, http, lines)

    def pump() -> None:  # keep reading so the pipe never fills
        for line in proc.stdout:
            lines.append(line)

    sp.pump = threading.Thread(target=pump, daemon=True)
    sp.pump.start()
    return sp


@contextlib.contextmanager
def serving(*args: str, **kw):
    """``start_server`` as a context manager that also checks the clean exit (code 0)."""
    sp = start_server(*args, **kw)
    try:
        yield sp
    finally:
        assert sp.stop() == 0, sp.log
