"""The fuzzer against our own server (tiny model): the oracles hold, and the findings the
fuzzer turned up in it stay as regression tests."""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path


from codec.enums import Op
from codec.framing import encode_request_header
from codec.payloads import decode_meta
from tests.helpers import start_server
from tools.fuzzer import schedule
from tools.fuzzer.execute import RunConfig, run_case
from tools.fuzzer.oracles import take_baseline
from tools.fuzzer.target import Target

ROOT = Path(__file__).resolve().parents[1]
SERVER_ARGS = ("--model", "tiny", "--no-http", "--log-level", "WARNING")


def run_cases(server, seed: int, indexes) -> list:
    async def go():
        target = Target(server.host, server.port)
        baseline = await take_baseline(target, 5.0)
        return [(i, await run_case(schedule.case_at(seed, i), target, baseline, RunConfig(deadline=5.0)))
                for i in indexes]

    return asyncio.run(go())


def test_smoke_and_first_sweep_rounds_find_nothing(server, tmp_path):
    n_smoke, _ = schedule.phase_sizes()
    p = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "fuzz", "--target", f"{server.host}:{server.port}",
                        "--seed", "11", "--cases", str(n_smoke + 120), "--deadline", "5", "--out", str(tmp_path),
                        "--progress", "none", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    results = json.loads(p.stdout)
    assert p.returncode == 0 and results["findings"] == [], results
    assert "No findings" in p.stderr


def test_pin_streams_pipelines_and_dribbles_are_served(server):
    n_smoke, _ = schedule.phase_sizes()
    pin = next(i for i in range(n_smoke) if schedule.case_at(0, i).note == "valid DECODE.pin")
    wanted = {"pipeline", "dribble", "abrupt"}
    more = [i for i in range(n_smoke, n_smoke + 600) if schedule.case_at(0, i).generator in wanted][:12]
    for i, out in run_cases(server, 0, [pin, *more]):
        assert out.ok, (i, schedule.case_at(0, i).note, out.failures)
    out = dict(run_cases(server, 0, [pin]))[pin]
    assert out.responses[0].get("pin_pieces", 0) >= 1  # OK + pieces + close: the PIN dialect, no desync


def test_stateful_programs_hold_their_invariants(server):
    n_smoke, n_sweep = schedule.phase_sizes()
    start = n_smoke + n_sweep
    programs = [i for i in range(start, start + 200) if schedule.case_at(3, i).generator == "stateful"][:6]
    assert len(programs) == 6
    for i, out in run_cases(server, 3, programs):
        assert out.ok, (i, schedule.case_at(3, i).note, [f.to_json() for f in out.failures])


# Regression (fixed): found by `hydra-rpc fuzz` (payload_len.huge) — STATE_PUT zero-filled bytearray(payload_len) before reading.
def test_state_put_huge_payload_len_allocates_nothing(tiny_model_path):
    sp = start_server(*SERVER_ARGS)
    try:
        before = sp.peak_kib()
        with socket.create_connection((sp.host, sp.port), timeout=10) as s:
            s.sendall(encode_request_header(Op.STATE_PUT, 1, (1 << 31) + 1, 0) + b"1" + b"\x03" * 54)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(15)
            while s.recv(4096):  # the close comes after the request was handled
                pass
        grown_mib = (sp.peak_kib() - before) // 1024
    finally:
        sp.stop()
    assert grown_mib < 256, f"peak RSS grew by {grown_mib} MiB for a request of 71 bytes"


# Regression (fixed): found by `hydra-rpc fuzz` (malformed:meta) — CONFIGURE 1e400 echoed Infinity into the meta.
def test_configure_reply_meta_is_strict_json(server):
    from hydra_rpc.client import HydraClient

    async def go():
        c = await HydraClient.connect(server.host, server.port)
        try:
            r = await c.request(Op.CONFIGURE, b"", b'{"sampling":{"temp":1e400}}', timeout=10)
            sane = await c.request(Op.CONFIGURE, b"", b'{"sampling":{"temp":0.8}}', timeout=10)
            return r, sane
        finally:
            await c.close()

    r, sane = asyncio.run(go())
    meta = decode_meta(r.meta_raw)  # strict JSON: no Infinity echoed back
    assert r.ok and meta["rejected_keys"] == {"sampling.temp": "sampling.temp must be a finite number >= 0 (got inf)"}
    assert meta["params_applied"] == {}  # the value is rejected with its reason, never applied
    assert sane.ok and sane.meta["params_applied"] == {"sampling.temp": 0.8}, sane
