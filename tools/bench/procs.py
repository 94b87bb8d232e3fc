"""The processes a scenario starts: Hydra servers, ggml RPC servers, worker subprocesses.

Every process binds 127.0.0.1 only. Long-lived processes are started by :mod:`tools.spawn`
(output pumped from the start, ready when a line says so, the last lines kept for error
messages). Worker subprocesses (:mod:`tools.bench.workers`) print one
``BENCH_RESULT <json>`` line; everything else they print is log.
"""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from typing import Any

from tools.spawn import ROOT, ChildProcess, GgmlRpcServerProcess, HydraServerProcess, SpawnError, child_env

from .common import BenchError

RESULT_PREFIX = "BENCH_RESULT "
READY_PREFIX = "BENCH_READY "


def raise_fd_limit(want: int = 4096) -> int:
    """Raise this process's soft RLIMIT_NOFILE (children inherit it); returns the new soft limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


SAMPLING_SEED = 1234


class HydraServer(HydraServerProcess):
    """``hydra-rpc serve ARGS --port 0`` (or another launcher module taking the same flags)."""

    def __init__(self, args: list[str], *, http: bool = False, module: str = "hydra_rpc.cli serve",
                 label: str = "hydra-rpc server", timeout: float = 120.0, env: dict[str, str] | None = None):
        try:
            # a fixed sampling seed: the tiny models' random weights make an early end of generation
            # possible at the default temperature, and a run must not hinge on the draw
            super().__init__(["--host", "127.0.0.1", "--log-level", "WARNING", "--seed", str(SAMPLING_SEED), *args],
                             http=http, module=module,
                             label=label, timeout=timeout, env=env, keep_lines=200)
        except SpawnError as e:
            raise BenchError(str(e)) from None


class GgmlRpcServer(GgmlRpcServerProcess):
    """llama.cpp's own ggml RPC server from the wheel (``python -m hydra_rpc.ggml.child``)."""

    def __init__(self, threads: int, timeout: float = 60.0):
        try:
            super().__init__(threads, timeout=timeout)
        except SpawnError as e:
            raise BenchError(str(e)) from None


class RawPeer(ChildProcess):
    """:mod:`tools.bench.workers` ``raw-peer`` (a plain-socket source/sink of N bytes) or, with
    ``mode="echo-server"``, a minimal uvloop echo server."""

    def __init__(self, max_bytes: int = 0, timeout: float = 30.0, mode: str = "raw-peer"):
        super().__init__([sys.executable, "-m", "tools.bench.workers", mode,
                          json.dumps({"max_bytes": max_bytes})], mode, keep_lines=200)
        try:
            self.port = int(self.wait_for(re.compile(READY_PREFIX + r"(\d+)"), timeout).group(1))
        except SpawnError as e:
            raise BenchError(str(e)) from None
        self.host = "127.0.0.1"


class WorkerTimeout(BenchError):
    """A worker did not finish within its deadline (its stderr, with its stacks, in the message)."""


def _run_worker(mode: str, params: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "tools.bench.workers", mode, json.dumps(params)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise WorkerTimeout(f"worker {mode} {_brief(params)} timed out after {timeout:.0f}s; its stderr ends:\n"
                         f"{err[-4000:]}") from e
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise BenchError(f"worker {mode} exited {done.returncode} without a result:\n"
                     f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def _brief(params: dict[str, Any]) -> str:
    return "(" + ", ".join(f"{k}={params[k]}" for k in ("endpoint", "model") if k in params) + ")"


async def run_worker(mode: str, params: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """Run one worker subprocess to completion (off the event loop) and return its result. A
    worker still running 10 s before ``timeout`` prints its threads' stacks (shown in the error)."""
    params = {"stack_dump_after": max(1.0, timeout - 10), **params}
    return await asyncio.to_thread(_run_worker, mode, params, timeout)
