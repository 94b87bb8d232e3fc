"""Connections and what one client may hold (issue 13 items 8 and 9): one budget for the engine
port and HTTP together, kept under the open-files limit; never a silent drop; HTTP deadlines
and a body limit checked while the body streams."""
from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import socket
import sys

import pytest

from codec.enums import Op, Status
from hydra_rpc.client import HydraClient
from hydra_rpc.conn_budget import RESERVED_FDS, ConnectionBudget
from tests.helpers import log_shows, poll_until, serving
from tools.spawn import HYDRA_HTTP, HYDRA_LISTENING, ChildProcess


async def closed_by_server(reader: asyncio.StreamReader, deadline: float) -> bool:
    try:
        while await asyncio.wait_for(reader.read(65536), deadline):
            pass
        return True
    except ConnectionError:
        return True


async def http_get(port: int, path: str = "/health", timeout: float = 30) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        return await asyncio.wait_for(r.read(), timeout)
    finally:
        w.close()


def test_the_budget_leaves_descriptors_to_the_server():
    b = ConnectionBudget.for_fd_limit(1024, nofile=1024, in_use=40)
    assert b.ceiling == 1024 - 40 - RESERVED_FDS and b.max_connections < b.ceiling
    assert ConnectionBudget.for_fd_limit(100, nofile=20000, in_use=40).max_connections == 100
    b.open = b.max_connections
    assert not b.over_limit and b.has_room
    b.open += 1
    assert b.over_limit and b.has_room  # answered, then closed
    resumed = []
    b.open = b.ceiling
    b.wait_for_room(lambda: resumed.append(1))
    b.closed()
    assert resumed == [1]


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_one_limit_for_both_ports_and_every_refusal_answers(tiny_model_path):
    with serving("--model", "tiny", "--max-connections", "3", "--log-level", "WARNING") as sp:
        assert "at most 3 connections, engine port and HTTP together" in sp.log
        idle = [await asyncio.open_connection("127.0.0.1", sp.http_port) for _ in range(2)]
        async with await HydraClient.connect(sp.host, sp.port) as c:
            assert (await c.request(Op.INFO)).ok  # 3 open: the limit
            reply = await http_get(sp.http_port)  # the 4th, over HTTP: 503, then closed
            assert reply.startswith(b"HTTP/1.1 503") and b"connection limit of 3" in reply, reply
            async with await HydraClient.connect(sp.host, sp.port) as d:  # the 4th, on the engine port
                r = await d.request(Op.INFO)
                assert r.status == Status.BUSY and "connection limit of 3" in r.meta["error"], r
            for _, w in idle:
                w.close()
            # their places free once the server saw them close
            await poll_until(lambda: http_get(sp.http_port), lambda r: r.startswith(b"HTTP/1.1 200"), 30)


@pytest.mark.asyncio
@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit")
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_more_silent_connections_than_descriptors_never_a_silent_drop(tiny_model_path, loop):
    """Open-files limit 400: 600 silent connections must leave new clients an answer (OK, BUSY
    or 503, when their turn comes), never a close without a reply. Both ways of accepting
    (conn_budget.Acceptor): libuv's own on uvloop, paused by closing its server at the
    ceiling; the acceptor's own bursts on asyncio's loop."""
    cmd = ["prlimit", "--nofile=256:400", sys.executable, "-m", "hydra_rpc.cli", "serve", "--port", "0",
           "--http-port", "0", "--model", "tiny", "--first-bytes-timeout", "3", "--loop", loop,
           "--log-level", "WARNING"]
    with ChildProcess(cmd, "limited server", keep_lines=500) as sp:
        port = int(sp.wait_for(HYDRA_LISTENING).group(2))
        http_port = int(sp.wait_for(HYDRA_HTTP).group(2))
        m = re.search(r"at most (\d+) connections.*open-files limit 400\): --max-connections 1024 lowered", sp.log)
        assert m and int(m.group(1)) < 400 - RESERVED_FDS, sp.log
        silent = []
        for i in range(600):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", http_port if i % 2 else port))
            silent.append(s)
        try:
            async with await HydraClient.connect("127.0.0.1", port, timeout=60) as c:
                r = await c.request(Op.INFO, timeout=60)
                assert r.status in (Status.OK, Status.BUSY), r
            reply = await http_get(http_port, timeout=60)
            assert reply.startswith((b"HTTP/1.1 200", b"HTTP/1.1 503")), reply
        finally:
            for s in silent:
                s.close()
        async with await HydraClient.connect("127.0.0.1", port) as c:
            await poll_until(lambda: c.request(Op.INFO), lambda r: r.ok, 60)
        assert "accepting resumes when one closes" in sp.log, sp.log[-3000:]  # the ceiling was reached
        assert sp.proc.poll() is None and "Too many open files" not in sp.log, sp.log[-3000:]


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", ["idle", "headers", "body"])
async def test_http_deadlines_close_idle_and_dribbling_clients(tiny_model_path, phase):
    """An idle connection is closed after --first-bytes-timeout; a client dribbling its headers
    or body at one byte a second is cut by the minimum rate (the stall deadline is far longer)."""
    with serving("--model", "tiny", "--first-bytes-timeout", "2", "--stall-timeout", "60", "--min-rate", "1024",
                 "--min-rate-window", "3", "--log-level", "INFO") as sp:
        r, w = await asyncio.open_connection("127.0.0.1", sp.http_port)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n"
        trickle = {"idle": b"", "headers": head, "body": b"{" + b" " * 199}[phase]
        if phase == "body":
            w.write(head)

        async def dribble() -> None:
            for b in trickle:
                w.write(bytes([b]))
                await asyncio.sleep(1.0)  # the dribbler's pace (the stall deadline is 60 s)

        sender = asyncio.ensure_future(dribble())
        try:
            assert await closed_by_server(r, 60)
        finally:
            sender.cancel()
            w.close()
        assert (await http_get(sp.http_port)).startswith(b"HTTP/1.1 200")
    reason = "idle for 2s" if phase == "idle" else "slower than 1024 bytes/s over 3s"
    await log_shows(sp, "closing HTTP connection from 127.0.0.1", reason)


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_unterminated_chunked_bodies_do_not_hold_memory(tiny_model_path):
    """Eight chunked bodies of 63 MB that never end held +542 MB: now each is refused at the
    body limit (1 MiB for a 4096-token slot) and what follows is dropped."""
    with serving("--model", "tiny", "--kv-unified-per-slot", "4096", "--log-level", "WARNING") as sp:
        sp.reset_peak()
        peak0 = sp.peak_kib()
        chunk = b"%x\r\n%s\r\n" % (1 << 20, b"a" * (1 << 20))

        async def one() -> bytes:
            r, w = await asyncio.open_connection("127.0.0.1", sp.http_port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")
            try:
                for _ in range(63):
                    w.write(chunk)
                    await w.drain()
            except ConnectionError:
                pass  # the server closed after its 413: expected
            try:
                return await asyncio.wait_for(r.readuntil(b"\r\n"), 30)
            except (ConnectionError, asyncio.IncompleteReadError):
                return b""
            finally:
                w.close()

        statuses = await asyncio.gather(*(one() for _ in range(8)))
        assert any(s.startswith(b"HTTP/1.1 413") for s in statuses), statuses
        assert (sp.peak_kib() - peak0) < 128 << 10, f"+{(sp.peak_kib() - peak0) >> 10} MiB for refused bodies"
        assert (await http_get(sp.http_port)).startswith(b"HTTP/1.1 200")


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_state_put_streams_past_the_json_body_limit(tiny_model_path):
    """The body limit is for JSON requests; a state PUT streams into the resident buffer under
    STATE_PUT's own cap (the largest blob this model's slot can produce)."""
    import aiohttp

    with serving("--model", "tiny", "--log-level", "WARNING", env={"HYDRA_HTTP_MAX_BODY": "4096"}) as sp:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{sp.http_port}") as http:
            body = {"prompt": "the quick brown fox " * 20, "max_tokens": 0, "id_slot": 0}
            async with http.post("/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
            async with http.get("/slots/0/state") as r:
                blob = await r.read()
            assert len(blob) > 4096
            async with http.put("/slots/1/state", data=blob) as r:
                assert r.status == 200 and (await r.json())["restored"] is True
            async with http.post("/v1/completions", json={"prompt": "x" * 5000, "max_tokens": 0}) as r:
                assert r.status == 413
        # 100 MiB: within the frame limit, beyond any state of the tiny model: refused unread
        reader, writer = await asyncio.open_connection("127.0.0.1", sp.http_port)
        try:
            writer.write(b"PUT /slots/1/state HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (100 << 20))
            assert b" 413 " in await asyncio.wait_for(reader.readline(), 10)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
