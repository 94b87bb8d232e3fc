"""The loader runs each call on a thread that ends with it (engine/executors.py,
FreshThreadExecutor): a thread that entered ggml's OpenMP regions while loading must not live
on, or libgomp stops spinning at the inference thread's barriers and decode slows down 3×."""
from __future__ import annotations

import asyncio
import threading

import pytest

from engine.executors import FreshThreadExecutor, make_loader_executor


def _loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hydra-loader")]


def test_calls_run_in_order_one_at_a_time_each_on_its_own_thread() -> None:
    ex = FreshThreadExecutor("test-fresh")
    gate, seen, running = threading.Event(), [], []

    def call(i: int) -> int:
        running.append(i)
        assert len(running) == 1, running  # never two at once
        if i == 0:
            gate.wait(30)
        seen.append((i, threading.get_ident()))
        running.remove(i)
        return i * 10

    futs = [ex.submit(call, i) for i in range(5)]
    gate.set()
    assert [f.result(30) for f in futs] == [0, 10, 20, 30, 40]
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    ex.shutdown(wait=True)
    assert not [t for t in threading.enumerate() if t.name.startswith("test-fresh")]


def test_an_exception_reaches_the_caller_and_the_next_call_still_runs() -> None:
    ex = FreshThreadExecutor("test-fresh")
    bad = ex.submit(lambda: 1 / 0)
    good = ex.submit(lambda: "ok")
    with pytest.raises(ZeroDivisionError):
        bad.result(30)
    assert good.result(30) == "ok"
    ex.shutdown(wait=True)


def test_shutdown_cancels_what_has_not_started_and_refuses_more() -> None:
    ex = FreshThreadExecutor("test-fresh")
    gate = threading.Event()
    first = ex.submit(gate.wait, 30)
    queued = ex.submit(lambda: "never")
    ex.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert first.result(30) is True and queued.cancelled()
    with pytest.raises(RuntimeError):
        ex.submit(lambda: None)
    ex.shutdown(wait=True)


def test_the_nice_value_applies_to_each_call_thread() -> None:
    import os

    ex = make_loader_executor(low_priority=True)
    try:
        nice = ex.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result(30)
    finally:
        ex.shutdown(wait=True)
    assert nice == 19


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_no_loader_thread_outlives_a_load_or_a_reload(tiny_model_path: str) -> None:
    """The real model: after start-up and after a shadow reload, the threads that built the
    models (and entered OpenMP regions doing so) are gone."""
    from engine.api import EngineApi
    from engine.config import EngineConfig
    from engine.model_params import ModelParams

    eng = EngineApi(EngineConfig(model=ModelParams(tiny_model_path, n_ctx=512, n_slots=1, n_threads=2)))
    await eng.start()
    try:
        await _until(lambda: not _loader_threads())
        out = await eng.configure({"n_ctx": 1024})
        assert out.reload_ticket is not None
        assert await eng.wait_reload(out.reload_ticket) == out.config_generation
        await _until(lambda: not _loader_threads())
    finally:
        await eng.stop()


async def _until(pred, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.01)
