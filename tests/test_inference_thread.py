"""The inference thread (engine/executors.py, InferenceThread): every model call of one engine
on one long-lived thread, in the order submitted — the actor's steps through ``call`` (an
asyncio future settled with one ``call_soon_threadsafe``) and everything else through
``submit``/``run_in_executor``."""
from __future__ import annotations

import asyncio
import threading

import pytest

from engine.executors import InferenceThread


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_calls_and_submits_run_on_one_thread_in_the_order_given() -> None:
    ex = InferenceThread("test-infer")
    gate, seen = threading.Event(), []

    def work(i: int) -> int:
        if i == 0:
            gate.wait(30)  # everything below is queued behind this one
        seen.append((i, threading.get_ident()))
        return i * 10

    async def scenario() -> list[int]:
        loop = asyncio.get_running_loop()
        futs = [ex.call(work, 0), asyncio.wrap_future(ex.submit(work, 1)), ex.call(work, 2),
                loop.run_in_executor(ex, work, 3), ex.call(work, 4)]
        gate.set()
        return list(await asyncio.gather(*futs))

    try:
        assert _run(scenario()) == [0, 10, 20, 30, 40]
        assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
        assert len({t for _, t in seen}) == 1 and seen[0][1] != threading.get_ident()
    finally:
        ex.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-infer")]


def test_an_exception_reaches_the_awaiting_task_and_the_next_call_still_runs() -> None:
    ex = InferenceThread("test-infer")

    def boom() -> None:
        raise ValueError("llama_decode failed")

    async def scenario() -> int:
        with pytest.raises(ValueError, match="llama_decode failed"):
            await ex.call(boom)
        return await ex.call(lambda: 7)

    try:
        assert _run(scenario()) == 7
    finally:
        ex.shutdown()


def test_a_call_cancelled_before_it_starts_does_not_run() -> None:
    ex = InferenceThread("test-infer")
    gate, ran = threading.Event(), []

    async def scenario() -> None:
        first = ex.call(gate.wait, 30)
        second = ex.call(ran.append, "second")
        second.cancel()
        gate.set()
        await first
        await ex.call(ran.append, "third")  # runs after the cancelled one would have

    try:
        _run(scenario())
        assert ran == ["third"]
    finally:
        ex.shutdown()


def test_shutdown_cancels_what_is_queued_and_refuses_more() -> None:
    ex = InferenceThread("test-infer")
    started, gate = threading.Event(), threading.Event()

    def hold() -> bool:
        started.set()
        return gate.wait(30)

    running = ex.submit(hold)
    queued = ex.submit(lambda: "never")
    assert started.wait(30)  # the first is running, the second waits in the queue
    ex.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert running.result(30) is True
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(lambda: None)
    ex.shutdown(wait=True)
    assert not ex._thread.is_alive()
