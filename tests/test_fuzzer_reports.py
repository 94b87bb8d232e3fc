"""Fuzzer reports a CI can trust: results.json on every run, cases per phase and generator,
a warning when a phase was cut short, the real elapsed time and exit 130 when interrupted,
a warning before fuzzing a live server, and one line when --spawn cannot start."""
from __future__ import annotations

import asyncio
import io
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import fuzz_cmd as base_fuzz_cmd, start_server, wait_until
from tools.fuzzer import schedule
from tools.fuzzer.cli import dump_tasks
from tools.fuzzer.progress import summary_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tiny_model_path):
    sp = start_server("--model", "tiny", "--no-http")  # INFO: one log line per request
    yield sp
    assert sp.stop() == 0, sp.log


def fuzz_cmd(*args: str) -> list[str]:
    return base_fuzz_cmd("--deadline", "5", *args)


def test_results_json_without_findings_counts_phases_and_warns(server, tmp_path):
    n_smoke, n_sweep = schedule.phase_sizes()
    out = tmp_path / "out"
    p = subprocess.run(fuzz_cmd("--target", f"{server.host}:{server.port}", "--seed", "5", "--cases",
                                str(n_smoke + 4), "--out", str(out)), cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["findings"] == [] and results["cases"] == n_smoke + 4
    cov = results["coverage"]
    assert cov["by_phase"] == {"smoke": n_smoke, "sweep": 4} and sum(cov["by_generator"].values()) == n_smoke + 4
    assert cov["stopped_by"] == "cases"
    assert cov["unfinished"] == {"phase": "sweep", "run": 4, "size": n_sweep, "cases_left": n_sweep - 4,
                                 "seconds_needed": cov["unfinished"]["seconds_needed"]}
    assert f"WARNING: the sweep phase did not finish within --cases {n_smoke + 4}: 4 of its {n_sweep}" in p.stdout
    assert "every oracle held" not in p.stdout and "cases by phase: smoke" in p.stdout
    assert "is a live server, not one started with --spawn" in p.stderr
    assert set(results["config_generation"]) == {"before", "after"}


def test_a_finished_phase_set_reads_as_every_oracle_held():
    results = {"cases": 3, "elapsed_s": 1.0, "rate": 3.0, "seed": 1, "target": "t", "findings": [],
               "coverage": {"by_phase": {"random": 3}, "by_generator": {"havoc": 3}, "finite_phases": {},
                            "stopped_by": "seconds", "unfinished": None}, "budget": {"seconds": 1.0}}
    text = summary_table(results)
    assert "WARNING" not in text and "every oracle held" in text and "cases by phase: random 3" in text
    results["coverage"]["unfinished"] = {"phase": "sweep", "run": 1, "size": 9, "cases_left": 8, "seconds_needed": 3}
    text = summary_table(results)
    assert "WARNING: the sweep phase did not finish within --seconds 1: 1 of its 9 cases" in text
    assert "about 3 s more" in text and "every oracle held" not in text


def test_an_interrupted_run_reports_its_real_time_and_exits_130(server, tmp_path):
    out = tmp_path / "out"
    before = len([line for line in server.lines if " request " in line])
    t0 = time.monotonic()
    proc = subprocess.Popen(fuzz_cmd("--target", f"{server.host}:{server.port}", "--seed", "9", "--seconds", "600",
                                     "--out", str(out)), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        def thirty_more() -> bool:
            assert proc.poll() is None, proc.communicate()
            return len([line for line in server.lines if " request " in line]) >= before + 30
        wait_until(thirty_more, "30 fuzz requests in the server's log", timeout=60)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    wall = time.monotonic() - t0
    assert proc.returncode == 130, stderr
    results = json.loads((out / "results.json").read_text())
    assert results["stopped_early"] == "interrupted" and results["coverage"]["stopped_by"] == "interrupted"
    assert results["cases"] > 0 and 0 < results["elapsed_s"] <= wall
    assert "stopped early: interrupted" in stderr and f"{results['cases']} cases in" in stdout


def test_spawn_that_cannot_start_is_one_line(tmp_path):
    p = subprocess.run(fuzz_cmd("--target", "127.0.0.1:0", "--spawn", "/nonexistent/server --port {port}",
                                "--cases", "1", "--out", str(tmp_path)), cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert p.stderr.startswith("hydra-rpc fuzz: could not start the --spawn command: /nonexistent/server:")


@pytest.mark.asyncio
async def test_sigusr1_says_where_each_task_waits():
    """A run that seems stuck is asked with SIGUSR1 (tests/helpers.py run_fuzz does on a timeout):
    every task's whole await chain, down to the innermost wait."""
    gate = asyncio.Event()

    async def innermost_wait() -> None:
        await gate.wait()

    async def outer() -> None:
        await innermost_wait()

    task = asyncio.create_task(outer(), name="stuck-one")
    await asyncio.sleep(0)
    out = io.StringIO()
    dump_tasks(out)
    gate.set()
    await task
    text = out.getvalue()
    assert "task stuck-one:" in text
    chain = text.split("task stuck-one:")[1]
    assert chain.index(" in outer") < chain.index(" in innermost_wait") < chain.index(" in wait")
