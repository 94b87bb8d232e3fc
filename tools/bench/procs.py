"""The processes a scenario starts: Hydra servers, ggml RPC servers, worker subprocesses.

Every process binds 127.0.0.1 only. A pump thread reads each long-lived process's merged
output from the start (so a chatty process never blocks on a full pipe) and keeps the last
lines for error messages. Worker subprocesses (:mod:`tools.bench.workers`) print one
``BENCH_RESULT <json>`` line; everything else they print is log.
"""
from __future__ import annotations

import asyncio
import collections
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .common import BenchError

ROOT = Path(__file__).resolve().parents[2]
RESULT_PREFIX = "BENCH_RESULT "
READY_PREFIX = "BENCH_READY "


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every child: this checkout first on the import path, unbuffered output."""
    env = dict(os.environ)
    env.update(extra or {})
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def raise_fd_limit(want: int = 4096) -> int:
    """Raise this process's soft RLIMIT_NOFILE (children inherit it); returns the new soft limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


class Process:
    """A long-lived child whose output is pumped; ``wait_for`` a line to know it is ready."""

    def __init__(self, cmd: list[str], label: str, env: dict[str, str] | None = None):
        self.label = label
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=child_env(env), cwd=ROOT)
        self.tail: collections.deque[str] = collections.deque(maxlen=200)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._pump = threading.Thread(target=self._read, name=f"pump-{label}", daemon=True)
        self._pump.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.tail.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def wait_for(self, pattern: re.Pattern[str], timeout: float = 60.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            m = pattern.search(line)
            if m:
                return m
        self.stop()
        raise BenchError(f"{self.label} did not become ready ({' '.join(self.cmd[1:])}):\n{self.log()}")

    def log(self, n: int = 40) -> str:
        return "".join(list(self.tail)[-n:])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._pump.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    # -- memory of the process (Linux /proc) -------------------------------------------
    def _status_kib(self, key: str) -> int | None:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            pass
        return None

    def cpu_seconds(self) -> float | None:
        """User + system CPU time the process has used so far (/proc/PID/stat)."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def rss_kib(self) -> int | None:
        return self._status_kib("VmRSS")

    def peak_kib(self) -> int | None:
        """VmHWM: the peak RSS since start or since :meth:`reset_peak`."""
        return self._status_kib("VmHWM")

    def reset_peak(self) -> bool:
        """Reset VmHWM to the current RSS (``echo 5 > /proc/PID/clear_refs``, Linux ≥ 4.0)."""
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            return True
        except OSError:
            return False


_LISTEN = re.compile(r"hydra-rpc listening on ([\d.]+):(\d+)")
_HTTP = re.compile(r"hydra-rpc http on ([\d.]+):(\d+)")


class HydraServer(Process):
    """``hydra-rpc serve ARGS --port 0`` (or another launcher module taking the same flags)."""

    def __init__(self, args: list[str], *, http: bool = False, module: str = "hydra_rpc.cli serve",
                 label: str = "hydra-rpc server", timeout: float = 120.0, env: dict[str, str] | None = None):
        cmd = [sys.executable, "-m", *module.split(), "--host", "127.0.0.1", "--port", "0",
               "--log-level", "WARNING", *args]
        cmd += ["--http-port", "0"] if http else ["--no-http"]
        super().__init__(cmd, label, env)
        m = self.wait_for(_LISTEN, timeout)
        self.host, self.port = m.group(1), int(m.group(2))
        self.http_port: int | None = None
        if http:
            self.http_port = int(self.wait_for(_HTTP, timeout).group(2))

    def __enter__(self) -> "HydraServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class GgmlRpcServer(Process):
    """llama.cpp's own ggml RPC server from the wheel (``python -m engine.ggml_rpc_child``)."""

    def __init__(self, threads: int, timeout: float = 60.0):
        super().__init__([sys.executable, "-m", "engine.ggml_rpc_child", "--host", "127.0.0.1", "--port", "0",
                          "--threads", str(threads)], "ggml rpc server")
        m = self.wait_for(re.compile(r"HYDRA_GGML_RPC_READY ([\d.]+):(\d+)"), timeout)
        self.host, self.port = m.group(1), int(m.group(2))

    def stop(self, timeout: float = 5.0) -> int | None:
        # it blocks in C forever; SIGINT reaches Python's sleep loop, SIGKILL is the fallback
        return super().stop(timeout)


class RawPeer(Process):
    """:mod:`tools.bench.workers` ``raw-peer``: a plain-socket source/sink of N bytes."""

    def __init__(self, max_bytes: int, timeout: float = 30.0):
        super().__init__([sys.executable, "-m", "tools.bench.workers", "raw-peer",
                          json.dumps({"max_bytes": max_bytes})], "raw socket peer")
        self.port = int(self.wait_for(re.compile(READY_PREFIX + r"(\d+)"), timeout).group(1))
        self.host = "127.0.0.1"


def _run_worker(mode: str, params: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "tools.bench.workers", mode, json.dumps(params)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"worker {mode} timed out after {timeout:.0f}s") from e
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise BenchError(f"worker {mode} exited {done.returncode} without a result:\n"
                     f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


async def run_worker(mode: str, params: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """Run one worker subprocess to completion (off the event loop) and return its result."""
    return await asyncio.to_thread(_run_worker, mode, params, timeout)
