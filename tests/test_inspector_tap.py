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
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from codec.enums import Op, status_name
from codec.payloads import encode_json_decode
from hydra_rpc.client import HydraClient
from tests.helpers import start_server

REPO = Path(__file__).resolve().parent.parent


class TapProcess:
    def __init__(self, upstream_port: int, *extra: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hydra_rpc.cli", "inspect", "--listen", "127.0.0.1:0", "--upstream",
             f"127.0.0.1:{upstream_port}", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
        self.err: list[str] = []
        ready = threading.Event()

        def watch() -> None:
            for raw in self.proc.stderr:
                self.err.append(raw.decode(errors="replace"))
                if "listening on" in self.err[-1]:
                    ready.set()
            ready.set()

        self.out_chunks: list[bytes] = []
        threading.Thread(target=watch, daemon=True).start()
        threading.Thread(target=lambda: self.out_chunks.extend(iter(lambda: self.proc.stdout.read(65536), b"")),
                         daemon=True).start()
        ready.wait(30)
        m = re.search(r"listening on ([\d.]+):(\d+)", "".join(self.err))
        if m is None:
            self.stop()
            raise RuntimeError("tap did not start:\n" + "".join(self.err))
        self.port = int(m.group(2))

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()
        return b"".join(self.out_chunks).decode()


@pytest.mark.asyncio
async def test_tap_forwards_bytes_unchanged_with_back_pressure():
    up_bytes, down_bytes = os.urandom(8 << 20), os.urandom(64 << 20)
    received = hashlib.sha256()
    got = {"n": 0}
    sent = {"n": 0}
    done = asyncio.Event()

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def send() -> None:
            for off in range(0, len(down_bytes), 1 << 20):
                writer.write(down_bytes[off:off + (1 << 20)])
                await writer.drain()
                sent["n"] = off + (1 << 20)
            writer.write_eof()

        sender = asyncio.create_task(send())
        while data := await reader.read(1 << 20):
            received.update(data)
            got["n"] += len(data)
        await sender
        done.set()
        writer.close()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tap = await asyncio.to_thread(TapProcess, port, "-q")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", tap.port)
        writer.write(up_bytes)
        await writer.drain()
        writer.write_eof()
        # Nobody reads the 64 MiB coming down yet: the upstream must stall once the socket
        # buffers and the tap's single chunk are full, instead of the tap soaking it all up.
        last = -1
        while sent["n"] != last:
            last = sent["n"]
            await asyncio.sleep(0.3)
        assert sent["n"] < 48 << 20, f"upstream pushed {sent['n'] >> 20} MiB into a client that reads nothing"
        down = hashlib.sha256()
        total = 0
        while data := await reader.read(1 << 20):
            down.update(data)
            total += len(data)
        await asyncio.wait_for(done.wait(), 30)
        writer.close()
        await writer.wait_closed()
    finally:
        out = await asyncio.to_thread(tap.stop)
        server.close()
        await server.wait_closed()
    assert total == len(down_bytes) and down.digest() == hashlib.sha256(down_bytes).digest()
    assert got["n"] == len(up_bytes) and received.digest() == hashlib.sha256(up_bytes).digest()
    assert out == "" and f"forwarded {len(up_bytes)} bytes up, {len(down_bytes)} bytes down" in "".join(tap.err)


@pytest.fixture(scope="module")
def server(tiny_model_path):
    sp = start_server("--model", "tiny", "--no-http", "--log-level", "WARNING")
    yield sp
    sp.stop()


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
