"""Fuzz reports that explain: each finding shows its input (opcode, key, the
mutated field and value) and its oracle; restarts say why (exit code, signal, RSS); a traceback
the target logs is a finding of its own; memory a CONFIGURE asked for is expected, not a finding;
a clean run says so."""
from __future__ import annotations

import functools
import json
import shlex
import sys
from pathlib import Path

import pytest

from codec.enums import Op
from codec.framing import encode_request
from tools.fuzzer import schedule
from tools.fuzzer.explain import config_asked, describe_input, input_line, requested_growth, tracebacks
from tools.fuzzer.progress import summary_table
from tests.helpers import run_fuzz

BROKEN = f"{shlex.quote(sys.executable)} tests/broken_server.py --port {{port}}"
N_SMOKE, _ = schedule.phase_sizes()
# Seed 1's sweep: op 0x00 (desync), the v3 header hash (crash), a CONFIGURE body that is a
# JSON array (the --tracebacks server's planted exception).
OP_SWEEP, V3_HASH, JSON_ARRAY = N_SMOKE, N_SMOKE + 2, N_SMOKE + 9


fuzz = functools.partial(run_fuzz, timeout=60)


def test_the_planted_cases_are_the_ones_expected():
    assert schedule.case_at(1, OP_SWEEP).mutated == {"field": "op", "value": "0x00"}
    assert schedule.case_at(1, V3_HASH).mutated == {"field": "DECODE v3 rule", "value": "hdr_hash"}
    assert schedule.case_at(1, JSON_ARRAY).mutated == {"field": "JSON payload", "value": "not_object.array"}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    out = tmp_path_factory.mktemp("planted")
    p = fuzz("--target", "127.0.0.1:0", "--spawn", BROKEN + " --tracebacks", "--seed", "1",
             *(x for i in (OP_SWEEP, V3_HASH, JSON_ARRAY) for x in ("--index", str(i))),
             "--deadline", "1", "--no-minimize", "--out", str(out), "--json")
    assert p.returncode == 1, p.stderr
    return out, json.loads(p.stdout), p.stderr


def test_summary_shows_each_findings_input_and_oracle(planted):
    _, results, summary = planted
    by_class = {f["class"]: f for f in results["findings"]}
    assert set(by_class) == {"desync", "crash", "traceback"}, results["findings"]
    crash = by_class["crash"]
    assert crash["input"]["op"] == "DECODE" and crash["input"]["key"] == "'1'"
    assert crash["input"]["field"] == "DECODE v3 rule" and crash["input"]["value"] == "hdr_hash"
    assert by_class["desync"]["input"]["op"] == "0x00" and by_class["desync"]["input"]["value"] == "0x00"
    lines = summary.splitlines()
    for f in results["findings"]:
        at = next(n for n, line in enumerate(lines) if f"{f['seed']}/{f['index']}" in line and line[:1].isdigit())
        assert lines[at + 1].strip() == f"input:  {f['input_line']}"
        assert lines[at + 2].strip().startswith(f"oracle: {f['class']}: ")
    assert "input:  DECODE key '1' (payload_len 478" in summary and "mutated DECODE v3 rule = hdr_hash" in summary
    assert "input:  CONFIGURE key '' (payload_len 7: '[1,2,3]') — json: mutated JSON payload = not_object.array" \
        in summary
    assert "oracle: crash: the target exited (killed by SIGABRT; peak RSS" in summary


def test_a_logged_traceback_is_a_finding_of_its_own(planted):
    out, results, summary = planted
    tb = next(f for f in results["findings"] if f["class"] == "traceback")
    assert tb["rule"] == "AttributeError" and tb["index"] == JSON_ARRAY
    assert tb["detail"].startswith("the target logged a traceback: AttributeError: 'list' object has no attribute")
    assert "broken_server.py" in tb["detail"] and " in answer" in tb["detail"]
    doc = json.loads(Path(tb["file"]).read_text())
    assert "Traceback (most recent call last):" in doc["target_traceback"]
    assert doc["input_line"] == tb["input_line"]
    # a replay spawns its own copy, logs it aside, and finds the traceback again
    p = fuzz("--replay", tb["file"], "--json")
    assert p.returncode == 1, p.stderr
    assert "REPRODUCED traceback:AttributeError" in p.stderr
    assert (out / "target.log").read_text().count("=== start") == results["restarts"] + 1  # the run's log untouched


def test_restarts_say_why(planted):
    _, results, summary = planted
    log = results["restart_log"]
    assert results["restarts"] == len(log) >= 1
    first = log[0]
    assert first["reason"] == f"after a crash finding in case 1/{V3_HASH}"
    assert first["exit"] == {"returncode": -6, "signal": "SIGABRT"} and first["peak_rss_mib"] > 0
    assert f"restart 1: after a crash finding in case 1/{V3_HASH}: it had died (killed by SIGABRT), peak RSS" \
        in summary
    assert "exits: [" not in summary


def test_memory_the_request_asked_for_is_expected_not_a_finding(tmp_path):
    big = next(i for i in range(N_SMOKE, 6000) if schedule.case_at(1, i).note == "CONFIGURE n_ctx=16777216")
    over = next(i for i in range(N_SMOKE, 6000) if schedule.case_at(1, i).note == "CONFIGURE n_ctx=16777217")
    p = fuzz("--target", "127.0.0.1:0", "--spawn", BROKEN + " --greedy-config", "--seed", "1", "--index", str(over),
             "--index", str(big), "--max-rss-growth", "64", "--deadline", "2", "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["findings"] == [] and results["expected_count"] == 1
    (e,) = results["expected"]
    assert e["kind"] == "requested-memory" and e["case"] == f"1/{big}"
    assert "CONFIGURE n_ctx = 16777216" in e["input"] and "grew by 1" in e["detail"]
    assert "accepted n_ctx (tier T2)" in e["detail"]
    assert "expected, not findings (1): the target did what the request told it to" in p.stdout
    assert "No findings: every oracle held" in p.stdout


def test_a_clean_run_on_our_own_spawned_server(tmp_path, tiny_model_path):
    serve = f"{shlex.quote(sys.executable)} -m hydra_rpc.cli serve --model tiny --port {{port}} --no-http " \
            "--log-level WARNING"
    p = fuzz("--target", "127.0.0.1:0", "--spawn", serve, "--seed", "1", "--cases", str(N_SMOKE + 20),
             "--deadline", "5", "--out", str(tmp_path), timeout=120)
    results = json.loads((tmp_path / "results.json").read_text())
    assert p.returncode == 0 and results["findings"] == [], p.stdout + p.stderr
    assert results["restarts"] == 0 and results["restart_log"] == [] and results["expected"] == []
    assert "findings (" not in p.stdout and "target restarted" not in p.stdout
    assert "Traceback" not in (tmp_path / "target.log").read_text()


# ---------------------------------------------------------------------------------- units
def test_tracebacks_in_plain_indented_and_json_logs():
    plain = ("INFO ok\nTraceback (most recent call last):\n  File \"a.py\", line 3, in f\n    g()\nKeyError: 'x'\n\n"
             "During handling of the above exception, another exception occurred:\n\n"
             "Traceback (most recent call last):\n  File \"b.py\", line 9, in h\nValueError: no\nINFO next\n")
    assert [t[:2] for t in tracebacks(plain)] == [("ValueError: no", "b.py:9 in h")]
    indented = "ERROR x failed\n" + "".join("    " + line + "\n" for line in plain.splitlines()[1:5]) + "INFO y\n"
    assert [t[:2] for t in tracebacks(indented)] == [("KeyError: 'x'", "a.py:3 in f")]
    js = json.dumps({"level": "ERROR", "exc": "Traceback (most recent call last):\n  File \"c.py\", line 1, in m\n"
                                              "codec.errors.Truncated: short"})
    assert [t[:2] for t in tracebacks(js + "\n")] == [("codec.errors.Truncated: short", "c.py:1 in m")]
    assert tracebacks("WARNING closing: bad magic\n") == []


def test_requested_growth_needs_an_accepted_rebuild():
    ok = {"status": "OK", "meta": {"success": True, "tier": "T2", "params_applied": {}, "deferred_keys": ["n_ctx"],
                                   "rejected_keys": {}, "reload": "loading"}}
    assert "accepted n_ctx (tier T2)" in requested_growth([ok])
    rejected = {"status": "OK", "meta": {"success": False, "params_applied": {}, "deferred_keys": [],
                                         "rejected_keys": {"n_ctx": "too big"}}}
    sampling = {"status": "OK", "meta": {"tier": "T1", "params_applied": {"sampling.temp": 0.5}}}
    assert requested_growth([rejected]) is None and requested_growth([sampling]) is None
    assert requested_growth([{"status": "ERROR", "meta": ok["meta"]}]) is None


def test_input_line_of_a_length_lie_names_the_field_and_both_lengths():
    case = schedule.case_at(1, N_SMOKE + 1)  # payload_len.huge on CONFIGURE
    line = input_line(describe_input(case))
    assert line.startswith("CONFIGURE key '' (payload_len 1099511627776 (2 sent): '{}')")
    assert line.endswith("payload_len.huge: mutated payload_len = 1099511627776 (actual 2)")


def test_summary_of_restarts_by_a_still_running_target():
    results = {"cases": 2, "elapsed_s": 1.0, "rate": 2.0, "seed": 1, "target": "t", "findings": [], "restarts": 1,
               "exits": [], "restart_log": [{"reason": "after a hang finding in case 1/5", "peak_rss_mib": 40,
                                             "stopped": {"by": "SIGTERM", "returncode": 0}}]}
    text = summary_table(results)
    assert "target restarted 1 time(s): 0 after it died, 1 by the fuzzer after a finding or during minimization" in text
    assert ("restart 1: after a hang finding in case 1/5: still running, stopped by SIGTERM, exit code 0, "
            "peak RSS 40 MiB") in text


def test_a_request_carrying_a_hydra_config_asked_for_the_memory_its_rebuild_takes():
    """A PREFILL with ``hydra_config`` {"n_ctx": 16777216} is answered only once the engine has
    built that context (seconds, gigabytes): the growth is what it asked for, not a leak."""
    asked = encode_request(Op.PREFILL, b"0", b'{"prompt":"x","hydra_config":{"n_ctx":16777216}}')
    plain = encode_request(Op.PREFILL, b"0", b'{"prompt":"x"}')
    assert "hydra_config asked for n_ctx" in config_asked([plain, asked])
    assert config_asked([plain, b"\x00garbage", encode_request(Op.PREFILL, b"0", b'{"hydra_config": {}}')]) is None
