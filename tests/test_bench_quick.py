"""``hydra-rpc bench --quick`` end to end, so the harness does not rot.

Every scenario runs for a few seconds against real server processes; the test checks that
each one produced its JSON (samples, summary, budget rows), the markdown table and the
charts. It asserts nothing about speed: figures belong to the benchmark's report.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.cli import SCENARIOS
from tools.bench.plots import DRAW

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_quick_bench_writes_every_result(tmp_path):
    # a hang guard only: the bench bounds each --quick scenario itself (a stuck one fails with
    # the await it was stuck in), so this outer limit is never what reports a problem
    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "bench", "--quick", "--plot", "--blocking-baseline",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=640)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    for name in SCENARIOS:
        data = json.loads((out / f"{name}.json").read_text())
        assert data["scenario"] == name and not data["error"], data["error"]
        assert data["rows"] and data["summary"] and data["samples"], name
        assert data["machine"]["cpu_count"] and "loadavg_1m_before" in data["machine"], name
        if name in DRAW:  # a scenario without a chart (constrained) writes no PNG
            assert (out / f"{name}.png").stat().st_size > 1000, name
    summary = (out / "summary.md").read_text()
    assert "| scenario | metric |" in summary and all(name in summary for name in SCENARIOS)
    cpu = json.loads((out / "decode-overhead.json").read_text())["summary"]["cpu_us_per_token"]
    assert set(cpu) == {"bare_compute", "pin_compute", "pin_loop", "pin_client"}
    assert cpu["bare_compute"]["median"] > 0 and cpu["pin_compute"]["median"] > 0  # both decoded for real
    constrained = json.loads((out / "constrained.json").read_text())["summary"]
    for v in ("plain", "grammar", "json_schema", "tools-none", "tools", "reasoning-none", "reasoning"):
        assert constrained[v]["tokens"]["median"] > 0 and constrained[v]["decode_rate"]["median"], v
    assert constrained["tools"]["finish"] and "tool_calls" in constrained["tools"]["deltas"]  # a parsed call
    assert "reasoning_content" in constrained["reasoning"]["deltas"]
    reload = json.loads((out / "reload-stall.json").read_text())
    assert {r["variant"] for r in reload["samples"]["runs"]} == {"serve-old", "reject", "blocking"}
    for run in reload["samples"]["runs"]:  # every variant really reloaded, and said so
        assert run["generation_after"] > run["generation_before"] and run["reload"]["state"] == "swapped"


def test_thread_cpu_is_counted_per_thread():
    import os
    import threading
    import time

    from tools.spawn import cpu_used, thread_cpu_seconds

    burned, read = threading.Event(), threading.Event()
    tids: list[int] = []

    def burn() -> None:  # until this thread has used 0.3 s of CPU: a state, not a duration
        while time.thread_time() < 0.3:
            sum(range(1000))
        tids.append(threading.get_native_id())
        burned.set()
        read.wait(60)  # alive until read: /proc forgets a thread once it ends

    before = thread_cpu_seconds(os.getpid())
    t = threading.Thread(target=burn)
    t.start()
    try:
        assert burned.wait(60)
        after = thread_cpu_seconds(os.getpid())
    finally:
        read.set()
        t.join(60)
    tid = tids[0]
    assert after[tid] >= 0.25
    assert cpu_used(before, after) - cpu_used(before, after, skip=(tid,)) >= 0.25


def test_unknown_scenario_is_refused():
    done = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "bench", "no-such-scenario"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown scenario" in done.stderr


def test_the_recorded_command_names_no_output_folder():
    from tools.bench.cli import _without_out

    assert _without_out(["--runs", "3", "--out", "/some/where", "--docs", "--out=/x"]) == ["--runs", "3", "--docs"]


def test_a_stuck_ggml_client_is_run_again_and_the_report_says_so(monkeypatch):
    import asyncio

    from tools.bench import passthrough
    from tools.bench.common import Result
    from tools.bench.procs import WorkerTimeout

    calls = []

    async def fake_worker(mode, params, timeout):
        calls.append(params["endpoint"])
        if len(calls) == 1:
            raise WorkerTimeout("worker ggml-client (endpoint=127.0.0.1:9) timed out after 60s; its stderr ends:\nstack")
        return {"device": "RPC0"}

    monkeypatch.setattr(passthrough, "run_worker", fake_worker)
    res = Result("passthrough")
    out = asyncio.run(asyncio.wait_for(passthrough.client_run(res, "direct", ("127.0.0.1", 9), {}, 60), 10))
    assert out == {"device": "RPC0"} and calls == ["127.0.0.1:9", "127.0.0.1:9"]
    assert res.samples["retries"][0]["way"] == "direct" and "stack" in res.samples["retries"][0]["error"]
    assert res.notes and "run again" in res.notes[0]


def test_a_ggml_client_that_fails_is_not_run_again(monkeypatch):
    import asyncio

    from tools.bench import passthrough
    from tools.bench.common import BenchError, Result

    async def fake_worker(mode, params, timeout):
        raise BenchError("worker ggml-client exited 1 without a result")

    monkeypatch.setattr(passthrough, "run_worker", fake_worker)
    with pytest.raises(BenchError, match="without a result"):
        asyncio.run(asyncio.wait_for(passthrough.client_run(Result("passthrough"), "proxy", ("127.0.0.1", 9), {}, 60), 10))


def test_a_worker_result_larger_than_a_pipe_arrives_whole():
    """A poll timeline makes a worker's result line hundreds of KiB; one full run read it cut at
    64 KiB (a partial write on a non-blocking stdout, which ``print`` does not retry)."""
    from tools.bench.procs import RESULT_PREFIX
    from tools.spawn import ROOT, child_env

    code = ("import os, sys\nfrom tools.bench.workers import write_result\n"
            "os.set_blocking(sys.stdout.fileno(), False)\n"
            "write_result({'polls': [[i, i * 0.5, 0] for i in range(40000)]})\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=child_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    line = done.stdout.splitlines()[-1]
    assert len(line) > 4 * 65536
    assert len(json.loads(line[len(RESULT_PREFIX):])["polls"]) == 40000
