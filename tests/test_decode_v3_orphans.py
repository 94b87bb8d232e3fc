"""Merged DECODEs nobody can read the result of do not hold the slots (issue 13 item 6).

A merged DECODE runs detached: its client gets a ``decode_request_id`` and fetches the result
over HTTP later. A client that leaves before reading that id leaves a job nobody can ever read;
forty such frames without ``n_predict`` used to keep every slot busy for minutes (each slot's
queue full of them), and new PREFILLs got BUSY.
"""
from __future__ import annotations

import json
import select
import socket

import aiohttp
import pytest

from codec.decode_v3 import encode_decode_v3
from codec.enums import Op, Status
from codec.framing import RESPONSE_HEADER_SIZE, decode_response_header, encode_request
from hydra_rpc.config import ServerConfig
from hydra_rpc.hydra.decode_results import DecodeEntry, DecodeResults
from engine.jobs import EngineBusy, GenRequest
from hydra_rpc.client import HydraClient
from tests.engine_env import long_generation, scripted_engine
from tests.helpers import log_shows, poll_decode, serving
from tests.scripted_backend import until

HELLO = [{"role": "user", "content": "hi"}]


def v3_frame(slot: int, n_predict: int | None = None) -> bytes:
    gen = {"sampling": {}, "stop": [], "stream": False}
    if n_predict is not None:
        gen["n_predict"] = n_predict
    return encode_request(Op.DECODE, str(slot).encode(), encode_decode_v3({"generation": gen},
                                                                          json.dumps(HELLO).encode()))


def send_and_vanish(host: str, port: int, frame: bytes) -> None:
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(frame)


@pytest.mark.asyncio
@pytest.mark.timeout(180)
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_forty_decodes_from_clients_that_left_leave_the_slots_to_live_clients(tiny_model_path, loop):
    with serving("--model", "tiny", "--parallel", "4", "--no-http", "--loop", loop, "--log-level", "INFO") as sp:
        for i in range(40):
            send_and_vanish(sp.host, sp.port, v3_frame(i % 4))
        async with await HydraClient.connect(sp.host, sp.port) as c:
            for slot in range(4):  # before: BUSY "its queue is full", for minutes
                r = await c.request(Op.PREFILL, str(slot), json.dumps({"prompt": "x"}).encode(), timeout=60)
                assert r.ok, r
    # A merged DECODE never waits in a slot's queue (a busy slot answers BUSY, as the C++), and
    # every one that ran was stopped when its client turned out to be gone.
    decodes = [line for line in sp.log.splitlines() if "op=DECODE" in line]
    busy = sum("status=BUSY" in line for line in decodes)
    assert len(decodes) == 40 and "queue is full" not in sp.log, sp.log[-3000:]
    assert sp.log.count("merged DECODE") == 40 - busy, sp.log[-3000:]


def peek_reply(s: socket.socket, timeout: float) -> dict:
    """The merged DECODE reply's meta, left unread in the socket (so a close sends RST)."""
    r, _, _ = select.select([s], [], [], timeout)
    assert r, "no reply"
    while True:
        head = s.recv(65536, socket.MSG_PEEK)
        h = decode_response_header(head[:RESPONSE_HEADER_SIZE])
        if len(head) >= RESPONSE_HEADER_SIZE + h.meta_len:
            assert h.status == Status.OK, head
            return json.loads(head[RESPONSE_HEADER_SIZE:RESPONSE_HEADER_SIZE + h.meta_len])


@pytest.mark.asyncio
@pytest.mark.timeout(180)
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_a_client_that_resets_with_the_reply_unread_stops_its_decode(tiny_model_path, loop):
    """Deterministic: the reply is in the client's socket before it closes, so the close is a
    reset — unlike a client that read its id and then closed, whose job runs to its end."""
    with serving("--model", "tiny", "--parallel", "2", "--ctx-size", "32768", "--loop", loop, "--log-level", "INFO") as sp:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{sp.http_port}") as http:
            s = socket.create_connection((sp.host, sp.port), timeout=10)
            s.sendall(v3_frame(0))  # no n_predict: up to the whole 16384-token context
            meta = peek_reply(s, 30)
            s.close()
            res = await poll_decode(http, meta["decode_request_id"])
            assert res["status"] == "cancelled" and res["tokens_generated"] < 16000, res
            async with await HydraClient.connect(sp.host, sp.port) as c:
                r = await c.request(Op.DECODE, b"1", encode_decode_v3(
                    {"generation": {"n_predict": 8, "sampling": {}, "stop": [], "stream": False}},
                    json.dumps(HELLO).encode()))
                assert r.ok, r
            res = await poll_decode(http, r.meta["decode_request_id"])  # read, then closed: runs to its end
            assert res["status"] == "done" and res["stop_reason"] in ("length", "eos"), res
    await log_shows(sp, "reset the connection with the reply unread")


@pytest.mark.asyncio
async def test_a_detached_job_never_queues_and_is_bounded_by_the_result_table():
    async with scripted_engine(n_ctx_slot=4096) as env:
        eng = env.engine
        busy = await long_generation(eng, 0)
        with pytest.raises(EngineBusy, match="slot 0 is busy"):
            await eng.submit_admitted(GenRequest(0, prompt="x", n_predict=2, wait=False))
        assert eng.snapshot(0).queued == 0
        busy.cancel()
        await until(lambda: not eng.snapshot(0).is_processing, "slot 0 idle")
        # evicted while running (beyond the newest max_entries): cancelled, nobody can read it
        results = DecodeResults(ttl=300, max_entries=1)
        first = DecodeEntry(1, 0, await eng.submit_admitted(GenRequest(0, prompt="x", n_predict=4000, wait=False)))
        results.add(first)
        await until(lambda: eng.snapshot(0).job_id == first.job.id, "first job running")
        results.add(DecodeEntry(2, 1, GenRequest(1)))
        res = await first.job.result()
        assert res.stop_reason == "cancelled" and first.error.startswith("evicted")


def test_the_time_budget_is_never_longer_than_the_result_ttl(monkeypatch):
    monkeypatch.setenv("HYDRA_DECODE_BUDGET_S", "999")
    monkeypatch.setenv("HYDRA_DECODE_RESULT_TTL_S", "30")
    cfg = ServerConfig()  # the environment is read when the settings are built, and only there
    assert (cfg.decode_budget_s, cfg.decode_result_ttl_s) == (999, 30)
    assert DecodeResults(cfg.decode_result_ttl_s, cfg.decode_result_max, cfg.decode_budget_s).budget == 30
    assert DecodeResults(ttl=300, budget=5).budget == 5
