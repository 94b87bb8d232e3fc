"""Shared fixtures.

Every async test gets a timeout from pytest-timeout (``timeout`` in pyproject) and the
suite runs under either event loop: ``HYDRA_TEST_LOOP=uvloop`` (default) or ``asyncio``.
"""
from __future__ import annotations

import asyncio
import os

import pytest
import pytest_asyncio

LOOP = os.environ.get("HYDRA_TEST_LOOP", "uvloop")
DEFAULT_SERVER_ARGS = ("--model", "tiny", "--no-http", "--log-level", "WARNING")


def pytest_asyncio_loop_factories(config, item):
    """``HYDRA_TEST_LOOP``: ``uvloop`` (default), ``asyncio`` or ``both`` (each async test twice)."""
    import uvloop

    factories = {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}
    if LOOP == "both":
        return factories
    return {LOOP: factories[LOOP]}


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """The deterministic generated tiny llama GGUF (cached on disk by content hash)."""
    from engine.model_files import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture(scope="session")
def tiny_model_b_path(tmp_path_factory) -> str:
    """A second, different tiny model (other seed/shape) for reload tests."""
    from engine.model_files import ensure_tiny_model

    return str(ensure_tiny_model(variant="b"))


@pytest.fixture(scope="module")
def server(request, tiny_model_path):
    """One real server process per test module, started with the module's ``SERVER_ARGS`` (and
    ``SERVER_ENV``, extra environment); it must exit cleanly, with no traceback in its log."""
    from tests.helpers import start_server

    sp = start_server(*getattr(request.module, "SERVER_ARGS", DEFAULT_SERVER_ARGS),
                      env=getattr(request.module, "SERVER_ENV", None))
    yield sp
    assert sp.stop() == 0, sp.log
    assert "Traceback" not in sp.log, sp.log


@pytest_asyncio.fixture
async def client(server):
    """A Hydra client on the module's ``server`` fixture (a real server process)."""
    from hydra_rpc.client import HydraClient

    c = await HydraClient.connect(server.host, server.port)
    yield c
    await c.close()


@pytest_asyncio.fixture
async def http(server):
    """An aiohttp session on the module's ``server`` HTTP port."""
    import aiohttp

    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.http_port}") as s:
        yield s
