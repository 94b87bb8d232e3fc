"""The live tap (``hydra-rpc inspect --listen … --upstream …``): a transparent proxy that decodes.

Bytes pass unchanged in both directions, a slow reader holds the upstream back (the proxy does
not buffer on its behalf), and ``--write`` produces a pcap that file mode reads back into the
same messages the tap printed live.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from codec.enums import Op, status_name
from codec.payloads import encode_json_decode
from hydra_rpc.client import HydraClient
from tools.spawn import ChildProcess

REPO = Path(__file__).resolve().parent.parent


class TapProcess(ChildProcess):
    """``hydra-rpc inspect --listen``: its log (stderr) in ``lines``, its decoded output (stdout) apart."""

    def __init__(self, upstream_port: int, *extra: str):
        super().__init__([sys.executable, "-m", "hydra_rpc.cli", "inspect", "--listen", "127.0.0.1:0", "--upstream",
                          f"127.0.0.1:{upstream_port}", *extra], "inspector tap", binary_stdout=True)
        self.port = int(self.wait_for(re.compile(r"listening on ([\d.]+):(\d+)"), 30).group(2))

    def stop(self) -> str:
        super().stop()
        return self.stdout_bytes().decode()


def _in_flight_bound() -> int:
    """The most bytes the kernel and the tap can hold between an upstream and a client that reads
    nothing, when the tap applies back-pressure: two TCP connections, each at most a full receive
    buffer plus a full send buffer, and the tap's own small buffers."""
    def max_of(name: str) -> int:
        return int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])

    return 2 * (max_of("tcp_rmem") + max_of("tcp_wmem")) + (4 << 20)


PING = 16 << 10
STALLED_PINGS = 64  # round trips through the tap in a row during which the upstream pushed nothing


@pytest.mark.asyncio
async def test_tap_forwards_bytes_unchanged_with_back_pressure():
    bound = _in_flight_bound()
    down_bytes = os.urandom(bound + (16 << 20))
    up_sent, received = hashlib.sha256(), hashlib.sha256()
    got = {"n": 0}
    arrived = asyncio.Event()
    state: dict = {"written": 0, "transport": None}
    done = asyncio.Event()

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def send() -> None:
            for off in range(0, len(down_bytes), 1 << 20):
                writer.write(down_bytes[off:off + (1 << 20)])
                state["written"] = min(off + (1 << 20), len(down_bytes))
                await writer.drain()
            writer.write_eof()

        state["transport"] = writer.transport
        sender = asyncio.create_task(send())
        while data := await reader.read(1 << 20):
            received.update(data)
            got["n"] += len(data)
            arrived.set()
        await sender
        done.set()
        writer.close()

    def pushed() -> int:
        """Bytes the upstream has handed to its kernel so far."""
        t = state["transport"]
        return state["written"] - (t.get_write_buffer_size() if t is not None else 0)

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tap = await asyncio.to_thread(TapProcess, port, "-q")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", tap.port)
        # Nobody reads what comes down. Each ping goes up through the tap and is waited for at the
        # upstream, so the tap's event loop has run between two looks at the upstream. A tap that
        # ignores back-pressure reads down bytes whenever it runs, so the upstream keeps pushing
        # until the whole payload sits in the tap; with back-pressure it stops for good once the
        # buffers in between are full. No clock is involved: a starved tap just takes longer.
        up_total, quiet, streak_start = 0, 0, -1
        while quiet < STALLED_PINGS:
            ping = os.urandom(PING)
            up_sent.update(ping)
            up_total += len(ping)
            writer.write(ping)
            await writer.drain()
            while got["n"] < up_total:
                arrived.clear()
                await asyncio.wait_for(arrived.wait(), 60)
            now = pushed()
            assert now <= bound, f"the upstream pushed {now >> 20} MiB into a client that reads nothing"
            if now - streak_start < PING:
                quiet += 1
            else:
                quiet, streak_start = 0, now
        writer.write_eof()
        down = hashlib.sha256()
        total = 0
        while data := await reader.read(1 << 20):
            down.update(data)
            total += len(data)
        await asyncio.wait_for(done.wait(), 60)
        writer.close()
        await writer.wait_closed()
    finally:
        out = await asyncio.to_thread(tap.stop)
        server.close()
        await server.wait_closed()
    assert total == len(down_bytes) and down.digest() == hashlib.sha256(down_bytes).digest()
    assert got["n"] == up_total and received.digest() == up_sent.digest()
    assert out == "" and f"forwarded {up_total} bytes up, {len(down_bytes)} bytes down" in tap.log


def _comparable(rec: dict) -> dict:
    # Live output prints a request before its response exists (as tshark does in one pass), so
    # the request's own record has no status or pair yet; the response carries both.
    return {k: v for k, v in rec.items() if k not in ("ts", "ts_last", "frame", "frame_last", "latency_ms", "ttfb_ms",
                                                      "stream", "src", "dst", "number", "pair", "status", "status_code", "error")}


@pytest.mark.asyncio
async def test_tap_decodes_live_and_its_pcap_reads_back(server, tmp_path):
    pcap = tmp_path / "tap.pcap"
    tap = await asyncio.to_thread(TapProcess, server.port, "--json", "--write", str(pcap))
    log = []
    try:
        async with await HydraClient.connect("127.0.0.1", tap.port) as c:
            direct = await HydraClient.connect("127.0.0.1", server.port)
            async with direct:
                for op, key, payload in [(Op.INFO, b"", b""), (Op.STATE_META, b"2", b""),
                                         (Op.PREFILL, b"0", b'{"messages":[{"role":"user","content":"hi"}]}'),
                                         (Op.STATE_GET, b"0", b""), (Op.STATE_META, b"9", b"")]:
                    r = await c.request(op, key, payload, b"via-tap", timeout=60)
                    log.append((op.name, key.decode(), status_name(r.status)))
                    if op == Op.STATE_GET:  # the same bytes as asking the server directly
                        d = await direct.request(op, key, payload, timeout=60)
                        assert (d.status, d.meta_raw, d.payload) == (r.status, r.meta_raw, r.payload)
        async with await HydraClient.connect("127.0.0.1", tap.port) as c:
            await c.send(Op.DECODE, b"1", encode_json_decode(3, [{"role": "user", "content": "x"}]))
            hdr, _ = await c.read_head()
            pieces = [p async for p in c.pin_pieces()]
            log.append(("DECODE", "1", status_name(hdr.status)))
    finally:
        out = await asyncio.to_thread(tap.stop)
    live = [json.loads(line) for line in out.splitlines()]
    resps = sorted((r for r in live if r["direction"] == "response"), key=lambda r: r["number"])
    assert [(r["op"], r["key"], r["status"]) for r in resps] == log
    assert all(r["trace"] == "via-tap" and r["pair"] is not None for r in resps[:-1])
    numbers = {r["number"]: r for r in live}
    assert all(numbers[r["pair"]]["direction"] == "request" for r in resps)
    pin = next(r for r in live if r["direction"] == "response" and r.get("dialect") == "pin")
    assert next(f for f in pin["fields"] if f["name"] == "hydra.pin")["value"]["pieces"] == len(pieces)
    proc = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "hydra_rpc.cli", "inspect", str(pcap),
                                                    "--json"], capture_output=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    replay = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["op"], r["key"], r["status"]) for r in replay if r["direction"] == "request"] == log
    assert all(r["pair"] is not None for r in replay)
    key = lambda r: (r["direction"] == "response", r["op"], r["key"] if "key" in r else "", r["stream_offset"])  # noqa: E731
    assert sorted(map(_comparable, live), key=key) == sorted(map(_comparable, replay), key=key)
