"""Test helpers: a real server process on 127.0.0.1 and small client utilities."""
from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from codec.errors import CodecError
from tools.spawn import HydraServerProcess

ServerProcess = HydraServerProcess


def start_server(*args: str, timeout: float = 60.0, env: dict | None = None) -> HydraServerProcess:
    """Start ``hydra-rpc serve ARGS --port 0`` (HTTP on a free port unless ``--no-http``) and wait
    until it prints its address(es)."""
    return HydraServerProcess(list(args), http="--no-http" not in args, timeout=timeout, env=env)


@contextlib.contextmanager
def serving(*args: str, **kw):
    """``start_server`` as a context manager that also checks the clean exit (code 0)."""
    sp = start_server(*args, **kw)
    try:
        yield sp
    finally:
        assert sp.stop() == 0, sp.log


def outcome(fn, *args, **kwargs):
    """``("ok", result)`` or ``("err", None)`` when the codec refuses: compares two decoders."""
    try:
        return ("ok", fn(*args, **kwargs))
    except CodecError:
        return ("err", None)


def wait_until(predicate, what: str, timeout: float = 20.0):
    """Call ``predicate`` until it returns something true, which is returned (synchronous twin
    of :func:`poll_until`; the deadline only turns a hang into a failure)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


async def poll_until(fetch, pred, timeout: float = 60.0):
    """``await fetch()`` until ``pred`` holds for what it returns, which is returned (the
    deadline only turns a hang into a failure)."""
    async with asyncio.timeout(timeout):
        while True:
            value = await fetch()
            if pred(value):
                return value
            await asyncio.sleep(0.01)


async def poll_decode(http, decode_id: int, timeout: float = 60.0) -> dict:
    """A merged DECODE's result over HTTP, once it is no longer pending (200)."""

    async def fetch() -> tuple[int, dict]:
        async with http.get(f"/v1/decode/{decode_id}") as r:
            return r.status, await r.json()

    status, body = await poll_until(fetch, lambda sb: sb[0] != 202, timeout)
    assert status == 200, body
    return body


async def log_shows(proc, *texts: str, timeout: float = 30.0) -> str:
    """A server process's log once it holds every one of ``texts`` (its output is read by a
    thread: a line the server wrote may not be in ``proc.log`` yet)."""
    async def log() -> str:
        return proc.log

    return await poll_until(log, lambda text: all(t in text for t in texts), timeout)


async def slot_meta_http(http, slot: int) -> dict:
    async with http.get(f"/slots/{slot}/state/meta") as r:
        assert r.status == 200, await r.text()
        return await r.json()


# greedy: the tiny model never samples EOS this way, so the generation runs its full length
LONG_CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4000, "temperature": 0}


@contextlib.asynccontextmanager
async def long_chat(http, slot: int, body: dict | None = None):
    """A long streamed chat on ``slot`` over HTTP (``http``: an aiohttp session), read by a
    background task, from its first decode step until the block ends; the slot is idle after."""

    async def consume() -> None:
        async with http.post("/v1/chat/completions", json={**(body or LONG_CHAT), "slot": slot, "stream": True}) as r:
            assert r.status == 200
            async for _ in r.content:
                pass

    task = asyncio.create_task(consume())
    try:
        await poll_until(lambda: slot_meta_http(http, slot), lambda m: m["operation"] == "decode")
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await poll_until(lambda: slot_meta_http(http, slot), lambda m: not m["is_processing"])


def fuzz_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hydra_rpc.cli", "fuzz", "--progress", "none", *args]


def run_fuzz(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``hydra-rpc fuzz --progress none ARGS``. One that runs past ``timeout`` fails the test with
    where each of its tasks waits (its SIGUSR1 dump) rather than with a bare timeout."""
    cmd = fuzz_cmd(*args)
    with subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGUSR1)
            try:
                out, err = p.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            pytest.fail(f"hydra-rpc fuzz ran past {timeout:g} s; its tasks:\n{err[-8000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)
