"""Logs no client can forge (text and JSON), the HTTP access log, JSON-only output with
--log-format json, and one /metrics label for every undefined opcode."""
from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from codec.enums import Op
from hydra_rpc.client import HydraClient
from hydra_rpc.config import ServerConfig
from hydra_rpc.conn_budget import ConnectionBudget
from hydra_rpc.http.server.messages import Request, Response
from hydra_rpc.http.server.serve import HttpServer
from hydra_rpc.observability.logs import JsonFormatter, TextFormatter, Throttle, escape, log_request
from hydra_rpc.observability.metrics import Metrics
from tests.helpers import start_server

FORGED = "x\n2030-01-01 00:00:00,000 ERROR hydra_rpc: forged\x00\x1b[31m"
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ")


def _capture(logger_name: str, formatter: logging.Formatter):
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(formatter)
    lg = logging.getLogger(logger_name)
    saved = lg.handlers[:], lg.level, lg.propagate
    lg.handlers[:] = [handler]
    lg.setLevel(logging.INFO)
    lg.propagate = False
    return buf, lambda: (setattr(lg, "handlers", saved[0]), lg.setLevel(saved[1]), setattr(lg, "propagate", saved[2]))


def test_escape_keeps_one_line_and_marks_backslashes():
    assert escape("a\nb\x00c\u2028") == "a\\nb\\x00c\\u2028"
    out = escape(FORGED)
    assert "\n" not in out and "\x00" not in out and "\x1b" not in out
    assert escape("a\\nb") != escape("a\nb")  # a literal backslash-n cannot pass for an escaped newline


def test_a_throttled_warning_is_said_once_per_interval_with_the_count_left_out():
    now = [100.0]
    t = Throttle(60.0, clock=lambda: now[0])
    assert t.admit() == ""  # the first is said
    assert [t.admit() for _ in range(3)] == [None] * 3  # the rest of the minute: counted
    now[0] = 159.9
    assert t.admit() is None
    now[0] = 160.0
    assert t.admit() == " (4 more since the last such line, not logged)"
    now[0] = 500.0  # a quiet spell: the next is said, with nothing left out
    assert t.admit() == "" and t.left_out == 0
    out, restore = _capture("hydra_rpc.test_throttle", TextFormatter())
    logger = logging.getLogger("hydra_rpc.test_throttle")
    try:
        now[0] = 600.0
        for peer in ("a", "b", "c"):
            t.warn(logger, "closed %s: unknown protocol", peer)
        now[0] = 700.0
        t.warn(logger, "closed %s: unknown protocol", "d")
    finally:
        restore()
    assert [line.split("hydra_rpc.test_throttle: ", 1)[-1] for line in out.getvalue().splitlines()] == [
        "closed a: unknown protocol", "closed d: unknown protocol (2 more since the last such line, not logged)"]


def test_text_request_line_escapes_and_quotes_client_fields():
    buf, restore = _capture("hydra_rpc", TextFormatter())
    try:
        log_request(op="INFO", key="0 status=OK", trace=FORGED, status="ERROR", req_bytes=0, resp_bytes=0,
                    started=time.perf_counter(), peer="127.0.0.1:1", conn=1, rule="v3.hdr_hash", tokens=7)
    finally:
        restore()
    text = buf.getvalue()
    assert text.count("\n") == 1 and "\x00" not in text
    assert 'key="0 status=OK"' in text and " status=ERROR " in text
    assert " rule=v3.hdr_hash" in text and text.rstrip().endswith("tokens=7")


def test_a_traceback_never_starts_a_line_like_a_record():
    buf, restore = _capture("hydra_rpc", TextFormatter())
    try:
        try:
            raise ValueError(FORGED)
        except ValueError:
            logging.getLogger("hydra_rpc").exception("handler failed", extra={"fields": {"trace": FORGED}})
    finally:
        restore()
    lines = buf.getvalue().splitlines()
    assert RECORD_START.match(lines[0]) and "trace=" in lines[0]
    assert all(line.startswith("    ") for line in lines[1:]), lines


def test_json_formatter_escapes_in_json():
    rec = logging.LogRecord("hydra_rpc", logging.INFO, __file__, 1, "request", None, None)
    rec.fields = {"trace": FORGED}
    line = JsonFormatter().format(rec)
    assert "\n" not in line and json.loads(line)["trace"] == FORGED


def test_metrics_unknown_opcodes_share_one_label():
    m = Metrics()
    for op in ("0x99", "0x98", "0xFF", "INFO"):
        m.observe_request(op, "ERROR", 0.001, 0, 0)
    text = m.render().decode()
    assert 'op="unknown",status="ERROR"} 3.0' in text and 'op="INFO"' in text
    assert "0x99" not in text and "0xFF" not in text


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_http_access_log_goes_through_our_formatter():
    buf, restore = _capture("hydra_rpc.http", TextFormatter())

    async def ok(request: Request) -> Response:
        return Response(b"ok")

    server = HttpServer(ok, ServerConfig(), ConnectionBudget(8, 32))
    server.listen("127.0.0.1", 0)
    port = server.address[1]
    try:
        url = f"http://127.0.0.1:{port}/a%0A2030-01-01%20ERROR%20forged?q=%00"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
        assert body == b"ok"
    finally:
        await server.close()
        restore()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1 and " http " in lines[0] and "method=GET" in lines[0] and "status=200" in lines[0], lines


def test_server_text_log_a_newline_in_a_trace_id_does_not_start_a_line(tiny_model_path):
    sp = start_server("--model", "tiny", "--no-http")

    async def drive() -> None:
        async with await HydraClient.connect(sp.host, sp.port) as c:
            await c.request(Op.INFO, b"", b"", FORGED.encode())
            await c.request(0x99, b"k\n", b"", FORGED.encode())

    try:
        asyncio.run(drive())
    finally:
        assert sp.stop() == 0, sp.log
    lines = sp.log.splitlines()
    forged = [line for line in lines if "forged" in line]
    assert len(forged) == 2 and all(RECORD_START.match(line) and " request " in line for line in forged), forged
    assert not any(line.startswith("2030-") for line in lines) and "\x00" not in sp.log


def test_json_log_format_every_line_is_json(tiny_model_path):
    proc = subprocess.Popen([sys.executable, "-m", "hydra_rpc.cli", "serve", "--model", "tiny", "--port", "0",
                             "--http-port", "0", "--log-format", "json"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ports: dict[str, int] = {}
    try:
        while "http_port" not in ports:
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
            ports.update({k: v for k, v in json.loads(line).items() if k in ("port", "http_port")})

        async def drive() -> None:
            async with await HydraClient.connect("127.0.0.1", ports["port"]) as c:
                await c.request(Op.INFO, b"", b"", FORGED.encode())
                await c.request(0x99, b"0", b"x")
            await asyncio.to_thread(lambda: urllib.request.urlopen(
                f"http://127.0.0.1:{ports['http_port']}/health", timeout=10).read())

        asyncio.run(drive())
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    lines += out.splitlines(True)
    records = [json.loads(line) for line in lines]  # every line parses
    msgs = [r["msg"] for r in records]
    assert any(m.startswith("hydra-rpc listening on") for m in msgs) and msgs[-1] == "hydra-rpc: stopped"
    assert any(r.get("trace") == FORGED for r in records)
