"""Thread priorities (engine/executors.py): the real-time event loop and what it starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

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
        # not permitted here (no root, CAP_SYS_NICE or RLIMIT_RTPRIO): the documented fallback —
        # the refusal is returned, not raised, and nothing changed
        assert error.startswith("PermissionError"), error
        assert os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK == os.SCHED_OTHER
        assert _in_thread(thread_policy).startswith("nice ")
        return
    assert own.startswith("SCHED_RR")
    assert started == "nice 0"  # SCHED_RESET_ON_FORK: no real-time inheritance
    assert os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK == os.SCHED_OTHER  # this thread untouched


# A process that may not use SCHED_RR: RLIMIT_RTPRIO 0 and no CAP_SYS_NICE (a process with it
# may whatever its rlimit says).
_FALLBACK_CHILD = r"""
import asyncio, json, logging, os, resource
resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))
from engine.executors import promote_loop_thread, start_workers, thread_policy

warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger().addHandler(Keep(logging.WARNING))

async def main():
    infer, loader, got = await start_workers(loop_realtime=True)
    infer.shutdown()
    loader.shutdown()
    return got

got = asyncio.run(main())
print(json.dumps({"got": got, "warnings": warnings}))
"""


def test_where_sched_rr_is_refused_the_loop_stays_normal_with_a_warning() -> None:
    """The fallback documented in docs/architecture.md, produced for real on any host: the
    kernel refuses SCHED_RR, the engine logs a warning, the loop keeps the normal policy and INFO
    ``thread_priorities`` says so; the worker threads start as usual."""
    root = Path(__file__).resolve().parent.parent
    # root: without CAP_SYS_NICE (util-linux's setpriv takes it out of the bounding set, so the
    # exec does not grant it back), as a container without that capability runs
    drop = ["setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice", "--"] if os.geteuid() == 0 else []
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([*drop, sys.executable, "-c", _FALLBACK_CHILD], cwd=root, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    got = out["got"]
    assert got["event_loop"].startswith("nice "), got  # not SCHED_RR: the refusal was real
    assert got["inference"] == got["loader"] == "nice 0", got
    assert any("SCHED_RR not permitted" in w and "normal scheduling policy" in w for w in out["warnings"]), out

