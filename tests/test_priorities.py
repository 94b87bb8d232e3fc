"""Thread priorities (engine/executors.py): the real-time event loop and what it starts."""
from __future__ import annotations

import os
import threading

import pytest

from engine.executors import make_inference_executor, promote_loop_thread, thread_policy


def _in_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(30)
    return out[0]


def test_promoted_thread_is_realtime_and_what_it_starts_is_not() -> None:
    def scenario():
        error = promote_loop_thread()
        if error:
            return error, None, None
        ex = make_inference_executor()
        try:
            started = ex.submit(thread_policy).result(30)
        finally:
            ex.shutdown()
        return None, thread_policy(), started

    error, own, started = _in_thread(scenario)
    if error:
        pytest.skip(f"SCHED_RR not permitted here: {error}")
    assert own.startswith("SCHED_RR")
    assert started == "nice 0"  # SCHED_RESET_ON_FORK: no real-time inheritance
    assert os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK == os.SCHED_OTHER  # this thread untouched

