"""A finished connection is freed by reference counting, not left to the cyclic GC.

Each connection once stayed a reference cycle (the transport's protocol and the deadline
timer's callback point back at it): ~17 objects per connection that only a full collection
freed — and with 1,000 connections open those collections stopped the event loop for
30–50 ms (docs/performance.md, 'Per request'). With the collector off, every connection object
must go as soon as its client leaves, however it leaves.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref

import aiohttp

import pytest

from codec.enums import Op, Status
from codec.framing import encode_request
from hydra_rpc.hydra import connection as connection_module
from hydra_rpc.http.server import connection as http_connection
from hydra_rpc.client import HydraClient
from tests.scripted_backend import until
from tests.test_state_put_memory import in_process_app


def track(monkeypatch, where: str, cls: type) -> list[weakref.ref]:
    """Replace ``cls`` at ``where`` by a subclass that keeps a weak reference to every instance."""
    made: list[weakref.ref] = []

    class Tracked(cls):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            made.append(weakref.ref(self))

    monkeypatch.setattr(where, Tracked)
    return made


@contextlib.contextmanager
def collector_off():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def all_freed(made: list[weakref.ref]) -> None:
    await until(lambda: all(ref() is None for ref in made), "every connection object freed")


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_finished_connections_are_freed_without_the_cyclic_gc(tiny_model_path, monkeypatch):
    made = track(monkeypatch, "hydra_rpc.hydra.server.HydraConnection", connection_module.HydraConnection)
    async with in_process_app(tiny_model_path) as app:
        host, port = app.address
        with collector_off():
            # closed by the client after requests; mid-frame; by a reset
            for _ in range(5):
                c = await HydraClient.connect(host, port)
                assert (await c.request(Op.INFO)).ok
                assert (await c.request(Op.STATE_META, b"0")).ok
                await c.close()
            r, w = await asyncio.open_connection(host, port)
            w.write(encode_request(Op.STATE_META, b"0")[:7])  # half a header
            await w.drain()
            await until(lambda: len(made) == 6, "the mid-frame connection dispatched")
            w.close()
            await w.wait_closed()
            c = await HydraClient.connect(host, port)
            assert (await c.request(Op.INFO)).ok
            c.writer.transport.abort()
            await until(lambda: len(made) == 7 and not app.server.connections, "every connection gone")
            await all_freed(made)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_connections_refused_at_the_limit_are_freed_without_the_cyclic_gc(tiny_model_path, monkeypatch):
    made = track(monkeypatch, "hydra_rpc.hydra.server.HydraConnection", connection_module.HydraConnection)
    async with in_process_app(tiny_model_path, max_connections=1) as app:
        host, port = app.address
        with collector_off():
            async with await HydraClient.connect(host, port) as held:
                assert (await held.request(Op.INFO)).ok  # the one place
                for _ in range(3):
                    async with await HydraClient.connect(host, port) as c:
                        r = await c.request(Op.INFO)
                        assert r.status == Status.BUSY and "connection limit of 1" in r.meta["error"], r
            await until(lambda: len(made) == 4 and not app.server.connections, "every connection gone")
            await all_freed(made)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_finished_http_connections_are_freed_without_the_cyclic_gc(tiny_model_path, monkeypatch):
    # the connection holds its transport, its timer, its parser and its requests' bodies
    made = track(monkeypatch, "hydra_rpc.http.server.serve.HttpConnection", http_connection.HttpConnection)
    async with in_process_app(tiny_model_path, http=True) as app:
        host, port = app.http.address
        with collector_off():
            for path in ("/health", "/v1/models", "/slots"):  # a connection each, closed by the client
                async with aiohttp.ClientSession() as s, s.get(f"http://{host}:{port}{path}") as r:
                    assert r.status == 200
            async with aiohttp.ClientSession() as s:  # one kept alive for two requests
                for _ in range(2):
                    async with s.get(f"http://{host}:{port}/health") as r:
                        assert r.status == 200
            r, w = await asyncio.open_connection(host, port)
            w.write(b"GET /health HTTP/1.1\r\nHo")  # gone mid-headers
            await w.drain()
            w.transport.abort()
            await until(lambda: len(made) == 5 and app.http.connections == 0, "every connection gone")
            await all_freed(made)
