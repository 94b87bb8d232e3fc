"""The fuzzer against tests/broken_server.py, which has the C++ engine's three failure classes:
it must find all three, minimize each, and a replay of each saved case must reproduce it."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from tools.fuzzer import schedule
from tests.helpers import run_fuzz as fuzz

BROKEN = f"{shlex.quote(sys.executable)} tests/broken_server.py --port {{port}}"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("broken")
    n_smoke, _ = schedule.phase_sizes()
    # The smoke phase, then the first sweep round: the decisive families come first.
    p = fuzz("--target", "127.0.0.1:0", "--spawn", BROKEN, "--seed", "1", "--cases", str(n_smoke + 6),
             "--deadline", "1", "--minimize-seconds", "5", "--out", str(out), "--json")
    assert p.returncode == 1, p.stderr
    return out, json.loads(p.stdout)


def test_finds_the_three_failure_classes(run):
    _, results = run
    classes = {f["class"] for f in results["findings"]}
    assert {"desync", "hang", "crash"} <= classes, results["findings"]
    gens = {f["class"]: f["generator"] for f in results["findings"] if f["class"] in ("hang", "crash")}
    assert gens == {"hang": "payload_len.huge", "crash": "v3.rules"}
    assert any(f["class"] == "desync" and f["generator"] == "op.sweep" for f in results["findings"])
    assert {"returncode": -6, "signal": "SIGABRT"} in results["exits"]


def test_each_finding_is_minimized_and_self_contained(run):
    out, results = run
    for f in results["findings"]:
        doc = json.loads(Path(f["file"]).read_text())
        assert doc["minimized"]["attempts"] > 0
        assert doc["minimized"]["bytes"] <= doc["original"]["bytes"]
        assert doc["case"]["messages"] and all(bytes.fromhex(m["hex"]) for m in doc["case"]["messages"])
        assert doc["replay"] == f"hydra-rpc fuzz --replay {f['file']}"
        assert doc["spawn"] and doc["oracle"] == f["class"]
    by_class = {f["class"]: json.loads(Path(f["file"]).read_text()) for f in results["findings"]}
    assert by_class["crash"]["exit"] == {"returncode": -6, "signal": "SIGABRT"}
    # the huge-length hang shrinks to its header (+ key): nothing else is needed
    assert by_class["hang"]["minimized"]["bytes"] <= 20 < by_class["hang"]["original"]["bytes"]


@pytest.mark.parametrize("klass", ["desync", "hang", "crash"])
def test_replay_reproduces(run, klass):
    _, results = run
    f = next(f for f in results["findings"] if f["class"] == klass and f["generator"] != "smoke")
    p = fuzz("--replay", f["file"], "--json")
    assert p.returncode == 1, p.stderr
    report = json.loads(p.stdout)
    assert report["reproduced"], report
    assert f"REPRODUCED {klass}" in p.stderr
