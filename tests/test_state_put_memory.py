"""STATE_PUT memory (issue 13 item 5): a payload is capped by the largest KV blob this model and
context can produce, before anything is allocated; receive buffers are given back without the
cyclic GC; the resident buffer does not keep a large payload's memory once idle."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import weakref

import pytest

from codec import decode_v3 as V3
from codec.enums import Op, Status
from codec.framing import encode_request, encode_request_header
from codec.kvblob import encode_kv_blob_header
from engine.config import EngineConfig
from engine.buffers import LeasedBuffer, lazy_buffer
from engine.jobs import GenRequest
from engine.model_params import ModelParams
from hydra_rpc.app import App
from hydra_rpc.client import HydraClient
from hydra_rpc.config import ServerConfig
from tests.helpers import serving
from tests.scripted_backend import until

PUT_SIZE = 1_500_000  # under the tiny model's cap for a 4096-token slot


class TrackedBuffers:
    """``lazy_buffer`` whose buffers can be watched with weak references."""

    def __init__(self):
        self.refs: list[weakref.ref] = []

    def __call__(self, n: int):
        buf = lazy_buffer(n)
        self.refs.append(weakref.ref(buf))
        return buf

    @property
    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_state_put_larger_than_the_model_can_produce_is_refused_unallocated(tiny_model_path):
    with serving("--model", "tiny", "--no-http", "--log-level", "WARNING") as sp:
        async with await HydraClient.connect(sp.host, sp.port) as c:
            await c.request(Op.INFO)  # the server is up and answering before the peak is reset
            sp.reset_peak()
            peak0 = sp.peak_kib()
            # 1 GiB claimed, 1 KiB sent: refused from the header (too large to drain: then closed)
            await c.send_raw(encode_request_header(Op.STATE_PUT, 1, 1 << 30, 0) + b"0" + b"\x03" * 1024)
            r = await asyncio.wait_for(c.read_response(), 30)
            assert r.status == Status.BAD_REQUEST and r.meta["rule"] == "state_put.size", r
            assert "largest KV blob this model can produce" in r.meta["error"]
        async with await HydraClient.connect(sp.host, sp.port) as c:
            # the kv segment of a merged DECODE is capped the same way
            prompt = json.dumps([{"role": "user", "content": "hi"}]).encode()
            hdr = V3.build_control_header(prompt, 100 << 20)
            head = V3.encode_decode_v3_frame(json.dumps(hdr).encode(), prompt)
            await c.send_raw(encode_request_header(Op.DECODE, 1, len(head) + (100 << 20), 0) + b"0" + head)
            r = await asyncio.wait_for(c.read_response(), 30)
            assert r.status == Status.BAD_REQUEST and r.meta["rule"] == "v3.kv_len", r
        async with await HydraClient.connect(sp.host, sp.port) as c:
            # 4 MiB, drained: the connection stays usable
            r = await c.request(Op.STATE_PUT, b"1", b"\x03" + bytes(4 << 20), timeout=60)
            assert r.status == Status.BAD_REQUEST and r.meta["rule"] == "state_put.size", r
            assert (await c.request(Op.INFO)).ok
            # a blob the model produced is taken whole, logits tail included
            body = json.dumps({"prompt": "hello there"}).encode()
            blob = await c.request(Op.PREFILL, b"0", body)
            assert blob.ok, blob
            r = await c.request(Op.STATE_PUT, b"1", blob.payload)
            assert r.ok and r.meta["logits_tail"] is True, r
        assert (sp.peak_kib() - peak0) < 64 << 10, "a refused STATE_PUT allocated what it claimed"


@contextlib.asynccontextmanager
async def in_process_app(tiny_model_path: str, http: bool = False, **server):
    app = App(ServerConfig(port=0, **server), EngineConfig(ModelParams(tiny_model_path, n_ctx=4096, n_slots=2),
                                                           low_priority=False), http_port=0 if http else None)
    await app.start()
    try:
        yield app
    finally:
        await app.shutdown(force=True)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_refused_concurrent_state_puts_give_their_buffers_back_without_the_cyclic_gc(tiny_model_path,
                                                                                          monkeypatch):
    """STATE_PUTs refused after their payload arrived — BUSY (the slot generates) or BAD_REQUEST
    (a state whose header the seq-state check refuses) — while the resident buffer is held by a
    transfer still arriving, so each got a buffer of its own. With the cyclic GC off, those must
    be freed as soon as the replies are out — an exception whose traceback a future or a frame
    keeps in a reference cycle would hold them."""
    tracked = TrackedBuffers()
    monkeypatch.setattr("hydra_rpc.services.LeasedBuffer", lambda: LeasedBuffer(tracked))
    async with in_process_app(tiny_model_path) as app:
        gc.collect()
        gc.disable()
        clients: list[HydraClient] = []
        try:
            job = app.engine.submit(GenRequest(0, prompt="busy", n_predict=4000))
            await until(lambda: app.engine.snapshot(0).job_id == job.id, "slot 0 generating")
            # paused as if its client stopped reading: slot 0 stays busy however fast the host decodes
            job.set_client_blocked(True)
            host, port = app.address
            clients += [await HydraClient.connect(host, port) for _ in range(5)]
            holder, *others = clients
            frame = encode_request(Op.STATE_PUT, b"0", b"\x03" + bytes(PUT_SIZE - 1))
            await holder.send_raw(frame[:PUT_SIZE // 2])
            await until(lambda: tracked.alive == 1, "the resident buffer leased")
            # slot 0 is busy: BUSY; slot 1 gets a well-framed blob whose state is refused: BAD_REQUEST
            garbage = encode_kv_blob_header(3, 1, [1]) + bytes(PUT_SIZE - 14)
            for i, c in enumerate(others):
                await c.send_raw(frame if i % 2 else encode_request(Op.STATE_PUT, b"1", garbage))
            for i, c in enumerate(others):
                r = await asyncio.wait_for(c.read_response(), 30)
                assert r.status == (Status.BUSY if i % 2 else Status.BAD_REQUEST), r
            assert len(tracked.refs) == 1 + len(others)
            await until(lambda: tracked.alive == 1, "the refused transfers' own buffers freed")
            await holder.send_raw(frame[PUT_SIZE // 2:])
            assert (await asyncio.wait_for(holder.read_response(), 30)).status == Status.BUSY
            for c in clients:
                await c.close()
            job.cancel()
            assert tracked.alive == 1  # the resident one: kept for the next transfer
        finally:
            gc.enable()
            for c in clients:  # after a failure too: an unclosed transport fails the next test's setup
                await c.close()


@pytest.mark.asyncio
async def test_a_large_resident_buffer_is_dropped_once_idle():
    buf = LeasedBuffer(idle_keep=1 << 20, idle_after=0.0)
    view, release = buf.lease(4 << 20)
    view[:4] = b"abcd"
    del view
    release()
    await until(lambda: buf.retained == 0, "the idle 4 MiB buffer dropped")
    small = LeasedBuffer(idle_keep=1 << 20, idle_after=0.0)
    _, release = small.lease(1024)
    release()
    assert small.retained == 1024 and small._idle_timer is None  # small enough to keep for good
    # leased again before the idle time is up: kept
    kept = LeasedBuffer(idle_keep=0, idle_after=3600)
    _, release = kept.lease(2 << 20)
    release()
    _, release = kept.lease(1 << 20)
    assert kept.retained == 2 << 20
    release()
