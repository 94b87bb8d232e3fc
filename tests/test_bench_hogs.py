"""busy-host's CPU-bound processes spin for as long as the bench lives, however long its
rounds take, and no longer: a bench killed outright leaves nothing spinning."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import wait_until
from tools.bench.busy_host import Hogs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60)

# a bench stand-in: starts two hogs, prints their pids, then waits to be killed
BENCH = ("import sys, time\nfrom tools.bench.busy_host import Hogs\nh = Hogs(2)\n"
         "print(*[p.pid for p in h.procs], flush=True)\ntime.sleep(120)\n")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie whose parent has not reaped it yet is gone too
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_hogs_spin_until_stopped_and_are_really_cpu_bound():
    with Hogs(1) as hogs:
        (proc,) = hogs.procs
        stat = Path(f"/proc/{proc.pid}/stat")
        wait_until(lambda: int(stat.read_text().rsplit(")", 1)[1].split()[11]) > 0, "the hog's CPU time")
        assert hogs.alive()
    assert proc.poll() is not None and not hogs.alive()


def test_hogs_stop_by_themselves_when_the_bench_is_killed():
    bench = subprocess.Popen([sys.executable, "-c", BENCH], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in bench.stdout.readline().split()]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
        bench.send_signal(signal.SIGKILL)
        bench.wait(10)
        wait_until(lambda: all(_gone(p) for p in pids), "the hogs to end with the bench", 30)
    finally:
        bench.kill()
        bench.wait(10)
        bench.stdout.close()


@pytest.mark.asyncio
async def test_busy_host_past_its_bound_reports_the_rounds_it_has_and_says_so(monkeypatch):
    """The rounds run against a scripted clock (each takes 100 s of it) and scripted rounds:
    none starts past ``BOUND_S``, and the report says how many ran of how many."""
    from types import SimpleNamespace

    from tools.bench import busy_host
    from tools.bench.common import BenchContext

    clock = [0.0]

    def now() -> float:
        return clock[0]

    async def server_round(ctx, flags, seconds):
        clock[0] += 100.0
        return {"decode_rate": 400.0, "tokens": 800, "meta_ms": {"p99": 3.0}, "meta_failed": 0,
                "meta_samples": [1.0, 3.0], "tokens_per_s": []}

    async def bare(kind, params, timeout):
        clock[0] += 100.0
        return {"decode_rate": 420.0, "tokens": 840}

    class NoHogs:
        def __init__(self, n):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def alive(self):
            return True

    monkeypatch.setattr(busy_host, "now", now)
    monkeypatch.setattr(busy_host, "_server_round", server_round)
    monkeypatch.setattr(busy_host, "run_worker", bare)
    monkeypatch.setattr(busy_host, "Hogs", NoHogs)
    ctx = BenchContext(quick=False, models=SimpleNamespace(busy="m.gguf"), reps=3, threads=2)
    res = await busy_host.run(ctx)
    ran = res.samples["runs"]
    rounds = 3 * (1 + len(busy_host._variants(ctx)))
    assert len(ran) == int(busy_host.BOUND_S // 100) + 1 < rounds  # a round starts only within the bound
    assert any(f"stopped after {len(ran)} of {rounds} rounds" in n for n in res.notes)
    assert res.rows and res.config["bound_s"] == busy_host.BOUND_S
