"""What the engine's step hand-off costs in wake-ups on this host, without the engine.

    python -m tools.bench.thread_wake [--steps 1500] [--out FILE]

Every step of the engine crosses threads twice: the inference thread hands its result to the
event loop (``call_soon_threadsafe``: a write to the loop's eventfd), and the loop hands the
next step back (a ``SimpleQueue.put`` the inference thread waits on). This replays that
exchange with the engine's shapes — a uvloop loop, a worker thread that "decodes" for
``--work-ms`` with the GIL released (``hashlib`` on a large buffer) then holds the GIL for 50 µs
(the step's own Python), the loop doing 250 µs of Python between steps — and reports, per
setting, the medians and spreads of:

- ``hand_back_us``: from the worker's ``call_soon_threadsafe`` to the loop running the callback;
- ``submit_us``: from the loop's ``put`` to the worker running.

Settings: ``free`` (the host as it is), ``one_cpu`` (both threads confined to one CPU: a wake
never crosses CPUs), ``other_cpu_busy`` (a spinning child process on every other CPU). A host
whose idle CPUs are slow to wake (a virtual machine halts an idle vCPU) shows it as ``free``
well above the other two. Prints (and with ``--out`` writes) one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import platform
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import uvloop

from tools.bench.common import p10_median_p90, result_json, write_run

LOOP_WORK_US = 250  # the loop's Python between two steps (publishing, the streams' turn, the next batch)
STEP_TAIL_US = 50  # the step's Python after its GIL-free part (sampling, events)
SETTINGS = ("free", "one_cpu", "other_cpu_busy")


def _hold_gil(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def _exchange(steps: int, work: bytes) -> dict[str, list[float]]:
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    marks: dict[str, float] = {}
    out: dict[str, list[float]] = {"hand_back_us": [], "submit_us": []}

    def settle(fut: asyncio.Future) -> None:
        marks["settled"] = time.perf_counter()
        fut.set_result(None)

    def worker() -> None:
        while (fut := jobs.get()) is not None:
            marks["started"] = time.perf_counter()
            hashlib.sha256(work).digest()  # the decode: the GIL released
            _hold_gil(STEP_TAIL_US)
            marks["handed"] = time.perf_counter()
            fut.get_loop().call_soon_threadsafe(settle, fut)
            fut = None

    async def steps_on_loop() -> None:
        loop = asyncio.get_running_loop()
        for i in range(steps):
            fut = loop.create_future()
            marks["put"] = time.perf_counter()
            jobs.put(fut)
            await fut
            if i:  # the first wakes a thread that never ran
                out["hand_back_us"].append((marks["settled"] - marks["handed"]) * 1e6)
                out["submit_us"].append((marks["started"] - marks["put"]) * 1e6)
            _hold_gil(LOOP_WORK_US)
            await asyncio.sleep(0)

    thread = threading.Thread(target=worker, name="thread-wake-worker")
    thread.start()
    try:
        uvloop.run(steps_on_loop())
    finally:
        jobs.put(None)
        thread.join()
    return out


def _setting(name: str, steps: int, work: bytes) -> dict[str, Any]:
    cpus = sorted(os.sched_getaffinity(0))
    spinners: list[subprocess.Popen] = []
    try:
        if name == "one_cpu":
            os.sched_setaffinity(0, {cpus[0]})  # this thread; the worker inherits it when started
        elif name == "other_cpu_busy":
            spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in cpus[1:]]
        return {k: p10_median_p90(v) for k, v in _exchange(steps, work).items()}
    finally:
        os.sched_setaffinity(0, set(cpus))
        for p in spinners:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.thread_wake", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--work-ms", type=float, default=2.0, help="the GIL-free part of a step")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    # sha256 runs at roughly 1 GB/s: about a millisecond per MB
    work = b"\0" * int(args.work_ms * 1_000_000)
    result = {"host": {"cpus": len(os.sched_getaffinity(0)), "kernel": platform.release(),
                       "python": platform.python_version()},
              "steps": args.steps, "work_ms": args.work_ms, "loop_work_us": LOOP_WORK_US,
              "step_tail_us": STEP_TAIL_US,
              "settings": {name: _setting(name, args.steps, work) for name in SETTINGS}}
    print(result_json(result), end="")
    write_run(args.out, result)
    return result


if __name__ == "__main__":
    main()
