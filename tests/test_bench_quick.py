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
        if name in DRAW and "skipped" not in data["summary"]:  # no chart without data (constrained, a skip)
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
    busy = json.loads((out / "busy-host.json").read_text())["samples"]["runs"]
    assert busy and all(r["hogs_alive"] for r in busy)  # every round decoded beside the CPU-bound processes
    reload = json.loads((out / "reload-stall.json").read_text())
    assert {r["variant"] for r in reload["samples"]["runs"]} == {"serve-old", "reject", "blocking"}
    for run in reload["samples"]["runs"]:  # every variant really reloaded, and said so
        assert run["generation_after"] > run["generation_before"] and run["reload"]["state"] == "swapped"
    vs = json.loads((out / "vs-llama-server.json").read_text())
    if "skipped" in vs["summary"]:  # --quick never builds llama-server: it ran only if it was cached
        assert vs["rows"][0]["metric"].startswith("skipped: no llama-server (")
    else:
        assert {r["variant"] for r in vs["samples"]["rounds"]} == {"llama-server", "hydra"}
        assert vs["summary"]["four_tok_s"]["ratios"] and vs["summary"]["one_tok_s"]["ratios"]
        pairs = vs["samples"]["pairs"]  # both servers served each alternating request
        (pair,) = pairs["one"]
        assert pair["hydra"] > 0 and pair["llama-server"] > 0
        assert vs["summary"]["one_paired_tok_s"]["ratios"] == [round(pair["hydra"] / pair["llama-server"], 4)]
        assert len(pairs["chat_one"]) == 1 and len(pairs["ttft"]) == 4 and len(pairs["cached"]) == 2
        for k in ("four", "chat_four"):  # four streams at once on each server in turn, all four answered
            (pair,) = pairs[k]
            assert pair["hydra"] > 0 and pair["llama-server"] > 0 and len(pair["hydra_finish"]) == 4
        assert vs["summary"]["four_paired_tok_s"]["ratios"] and vs["summary"]["chat_four_paired_tok_s"]["ratios"]
        assert len(pairs["whole"]) == 4 and all(p[f"{v}_finish"] in ("length", "stop") for p in pairs["whole"]
                                                for v in ("hydra", "llama-server"))  # whole answers, not streamed
        assert all(p[v] > 0 for k in ("chat_one", "ttft", "cached", "whole") for p in pairs[k]
                   for v in ("hydra", "llama-server"))
        assert vs["summary"]["chat_one_paired_tok_s"]["ratios"]
        assert vs["summary"]["ttft_paired_ms"]["ratios"] and vs["summary"]["cache_warm_paired_ms"]["ratios"]
        control = vs["samples"]["control"]  # the same pairs between two llama-server processes
        assert all(p[v] > 0 for k in ("one", "chat_one", "four", "chat_four", "ttft", "cached", "whole")
                   for p in control[k]
                   for v in ("llama-server", "llama-server-2"))
        assert vs["summary"]["control"]["one_paired_tok_s"]["ratios"]


VS_SKIPPED = "skipped: no llama-server (not built: run scripts/build_llama_server.sh to build it)"


def test_vs_llama_server_without_a_build_says_how_to_build_it(tmp_path):
    """No cached llama-server and --quick: the scenario builds nothing and says so, never silently."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_BENCH_LLAMA_SERVER", "HYDRA_BENCH_BUILD_LLAMA_SERVER")}
    env["LCP_WHEEL_CACHE"] = str(tmp_path / "empty-cache")
    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "bench", "vs-llama-server", "--quick",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((out / "vs-llama-server.json").read_text())
    assert not data["error"] and [r["metric"] for r in data["rows"]] == [VS_SKIPPED]
    assert VS_SKIPPED in done.stderr and VS_SKIPPED in (out / "summary.md").read_text()
    assert not (tmp_path / "empty-cache").exists() or not any((tmp_path / "empty-cache").glob("*llama-server*/llama-server"))


def test_vs_llama_server_reports_every_figure_as_a_ratio_per_round():
    from tools.bench.common import Result
    from tools.bench.vs_llama_server_figures import CONTROL, CONTROL_PREFIX, FIGURES, FLOOR_ROW, PAIRED, report

    def rnd(variant, i, scale):
        cpu = {"cores_busy": 1.5, "cpu_ms_per_token": 20.0 * scale, "main_thread_s": 1.0, "cpu_s": 10.0}
        return {"variant": variant, "round": i, "one_tok_s": 30.0 * scale, "ttft_ms": 50.0 / scale,
                "four_tok_s": 60.0 * scale * (1 + i), "eight_tok_s": 70.0 * scale, "slots_p99_ms": 5.0 * scale,
                "rss_mib": 400.0, "peak_rss_mib": 410.0, "startup_s": 1.0, "cpu_four": cpu,
                "cache_cold_ttft_ms": 900.0, "cache_warm_ttft_ms": 40.0, "chat_one_tok_s": 30.0 * scale,
                "chat_ttft_ms": 60.0, "chat_four_tok_s": 50.0 * scale,
                "requests": {"single": {"finish": "length"}, "four": [{"finish": "length"}] * 4,
                             "eight": [{"finish": "stop"}] * 8, "chat_one": {"finish": "stop"},
                             "chat_four": [{"finish": "length"}] * 4}}

    res = Result("vs-llama-server")
    rounds = [rnd(v, i, 0.5 if v == "hydra" else 1.0) for i in range(3) for v in ("llama-server", "hydra")]
    def pairs(ours, theirs, finish="length"):
        return [{"pair": i, "llama-server": theirs, "hydra": ours(i), "llama-server_finish": finish,
                 "hydra_finish": finish} for i in range(4)]

    control = {"one": [{"pair": i, "llama-server": 40.0, CONTROL: 39.6 + 0.2 * i} for i in range(4)],
               "ttft": [{"pair": i, "llama-server": 4.0, CONTROL: 4.4} for i in range(4)]}
    floor = {"hydra": {"rss_mib": 90.0}, "llama-server": {"rss_mib": 44.0}, "bare Python": {"rss_mib": 85.0}}
    report(res, rounds, 3, {"one": pairs(lambda i: 40.0 + i, 40.0), "chat_one": pairs(lambda i: 39.0, 40.0),
                            "ttft": pairs(lambda i: 2.0 + i, 4.0), "cached": pairs(lambda i: 12.0, 10.0),
                            "cold": pairs(lambda i: 95.0, 100.0), "whole": pairs(lambda i: 11.0, 10.0),
                            "four": pairs(lambda i: 63.0, 60.0, ["length", "stop", "length", "length"])},
           control, floor)
    rows = {r.metric: r for r in res.rows}
    assert [label for _, label, _, _ in FIGURES] == [r.metric for r in res.rows[:len(FIGURES)]]
    (_, one), (_, chat_one), (_, four), (_, chat_four), (_, ttft), (_, cached), (_, cold), (_, whole) = PAIRED
    paired = res.rows[len(FIGURES)]
    assert paired.metric == one[1] and paired.ok is True and paired.ratio == pytest.approx(41.5 / 40)
    assert res.summary[one[0]]["ratios"] == [1.0, 1.025, 1.05, 1.075]
    assert "1.04 (1.00–1.07) over 4 pairs; the control's 1.00 (0.99–1.00)" in paired.note
    assert "control" not in rows[chat_one[1]].note  # no control pairs for it
    assert rows[chat_one[1]].ok is False and res.summary[chat_one[0]]["ratios"] == [0.975] * 4
    assert rows[ttft[1]].ok is True and rows[ttft[1]].ratio == pytest.approx(3.5 / 4)  # medians: 3.5 ms vs 4
    assert rows[cached[1]].ok is False and res.summary[cached[0]]["ratios"] == [1.2] * 4
    assert rows[cold[1]].ok is True and res.summary[cold[0]]["ratios"] == [0.95] * 4
    assert rows[whole[1]].ok is False and rows[whole[1]].budget == "≤ 1.0× llama-server"  # 1.1× its time
    assert res.summary[whole[0]]["ratios"] == [1.1] * 4
    # four streams at once, alternating: the aggregate's ratio per pair, the rounds' budget
    assert rows[four[1]].ok is True and res.summary[four[0]]["ratios"] == [1.05] * 4
    assert chat_four[1] not in rows  # no pairs, no row
    # the control's pairs follow the paired figures: no budget, their ratio is the host's spread
    shown = len(FIGURES) + len(PAIRED) - 1  # every paired figure but chat_four's
    c_one, c_ttft = res.rows[shown:shown + 2]
    assert c_one.metric == CONTROL_PREFIX + one[1] and c_one.ok is None and not c_one.budget
    assert c_one.ratio == pytest.approx(39.9 / 40) and "1.00 (0.99–1.00) over 4 pairs" in c_one.note
    assert c_ttft.metric == CONTROL_PREFIX + ttft[1] and c_ttft.ratio == pytest.approx(1.1)
    assert res.summary["control"][one[0]]["ratios"] == [0.99, 0.995, 1.0, 1.005]
    assert set(res.summary["control"]) == {one[0], ttft[0]}  # no control pairs, no row
    four = rows[FIGURES[2][1]]
    assert four.ratio == pytest.approx(0.5) and four.ok is False and four.budget
    assert res.summary["four_tok_s"]["ratios"] == [0.5, 0.5, 0.5]
    assert rows[FIGURES[1][1]].ok is False  # TTFT twice as long
    assert rows[FIGURES[4][1]].ok is True  # /slots p99 half of llama-server's
    # with the answers kept, the /slots row is the p99 of all of them, each round's ratio in the note
    # (ours: six slow answers, all in one round — the median of the rounds' p99s would be 1 ms)
    for r in rounds:
        theirs, slow = r["variant"] == "llama-server", r["variant"] == "hydra" and r["round"] == 0
        r["slots_ms"] = [1.0] * 98 + [2.0] * 2 if theirs else [1.0] * 94 + [9.0] * 6 if slow else [1.0] * 100
    again = Result("vs-llama-server")
    report(again, rounds, 3)
    slots = {r.metric: r for r in again.rows}[FIGURES[4][1]]
    assert (slots.value, slots.baseline, slots.ok) == (pytest.approx(9.0), pytest.approx(2.0), False)
    assert "the p99 of 300 and 300 answers" in slots.note
    assert again.summary["slots_p99_ms"]["hydra"]["median"] == 2.5  # the rounds' own p99s, as before
    assert rows[FIGURES[5][1]].ok is True  # the same RSS: within "≤ 1.1×"
    assert "0.50 (0.50–0.50) over 3 rounds" in four.note
    # RSS over the bare Python server's: its own budget, llama-server's figure beside it
    last = res.rows[-1]
    assert last.metric == FLOOR_ROW and last.baseline_label == "bare Python" and last.ok is True
    assert last.ratio == pytest.approx(90 / 85) and "llama-server 44.0 MiB (ours 2.05× it)" in last.note
    assert res.summary["rss_floor"] == {"hydra": 90.0, "bare Python": 85.0, "llama-server": 44.0}
    heavier = Result("vs-llama-server")
    report(heavier, rounds, 3, {}, {}, {**floor, "hydra": {"rss_mib": 95.0}})
    assert heavier.rows[-1].ok is False  # 1.12× the floor
    older = Result("vs-llama-server")
    report(older, rounds, 3, {}, {})
    assert older.rows[-1].metric != FLOOR_ROW  # an older run without the floor: no row
    # 9 per round (eight streams, the chat), and each four-stream pair's one on both sides
    assert res.notes and "62 measured request(s) ended before max_tokens" in res.notes[0]


def test_vs_llama_server_says_when_our_four_streams_stepped_on_fewer_compute_threads():
    """A round where ours judged the host busy decodes slower for the host's reason: the CPU
    row and the summary carry how long, from the compute-thread counters of its /metrics."""
    from tools.bench.common import Result
    from tools.bench.vs_llama_server_figures import report

    def rnd(variant, i, reduced):
        cpu = {"cores_busy": 1.5, "cpu_ms_per_token": 20.0, "main_thread_s": 1.0, "cpu_s": 10.0}
        if reduced is not None:
            cpu["compute_threads"] = {"reduced_s": reduced, "lowered": 1.0 if reduced else 0.0}
        return {"variant": variant, "round": i, "one_tok_s": 30.0, "ttft_ms": 50.0, "four_tok_s": 60.0,
                "eight_tok_s": 70.0, "slots_p99_ms": 5.0, "rss_mib": 400.0, "peak_rss_mib": 410.0, "startup_s": 1.0,
                "cpu_four": cpu, "cache_cold_ttft_ms": 900.0, "cache_warm_ttft_ms": 40.0, "chat_one_tok_s": 30.0,
                "chat_ttft_ms": 60.0, "chat_four_tok_s": 50.0,
                "requests": {"single": {"finish": "length"}, "four": [], "eight": [], "chat_one": {"finish": "length"},
                             "chat_four": []}}

    def cpu_row(ours_reduced):
        res = Result("vs-llama-server")
        rounds = [rnd("llama-server", i, None) for i in range(3)] + [rnd("hydra", i, r) for i, r in enumerate(ours_reduced)]
        report(res, rounds, 3, {}, {})
        return res, next(r for r in res.rows if r.metric.startswith("server CPU per token"))

    res, row = cpu_row([0.0, 6.2, 0.0])
    assert "fewer compute threads for up to 6.2 s" in row.note
    assert res.summary["hydra"]["compute_threads_reduced_s_four"]["max"] == 6.2
    assert "compute_threads_reduced_s_four" not in res.summary["llama-server"]
    _, row = cpu_row([0.0, 0.0, 0.0])
    assert "fewer compute threads" not in row.note


def _thread_burning(cpu_s: float) -> tuple[int, dict[int, float], dict[int, float]]:
    """A thread that uses ``cpu_s`` of CPU (a state, not a duration): its id, and every thread's
    CPU read before it started and while it is still alive (/proc forgets a thread once it ends)."""
    import os
    import threading
    import time

    from tools.spawn import thread_cpu_seconds

    burned, read = threading.Event(), threading.Event()
    tids: list[int] = []

    def burn() -> None:
        start = time.thread_time()
        while time.thread_time() - start < cpu_s:
            sum(range(100))
        tids.append(threading.get_native_id())
        burned.set()
        read.wait(60)

    before = thread_cpu_seconds(os.getpid())
    t = threading.Thread(target=burn)
    t.start()
    try:
        assert burned.wait(60)
        after = thread_cpu_seconds(os.getpid())
    finally:
        read.set()
        t.join(60)
    return tids[0], before, after


def test_thread_cpu_is_counted_per_thread():
    from tools.spawn import cpu_used

    tid, before, after = _thread_burning(0.3)
    assert after[tid] >= 0.25
    assert cpu_used(before, after) - cpu_used(before, after, skip=(tid,)) >= 0.25


def test_thread_cpu_counts_less_than_a_clock_tick():
    # a short --quick run's compute thread can use under a tick (10 ms) of CPU: in ticks it read
    # as none, and a bench figure "CPU per token" came out 0
    tid, _, after = _thread_burning(0.002)
    assert 0.0019 <= after[tid] < 1.0


def test_unknown_scenario_is_refused():
    done = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "bench", "no-such-scenario"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown scenario" in done.stderr


def test_the_recorded_command_names_no_output_folder():
    from tools.bench.cli import _without_out

    assert _without_out(["--runs", "3", "--out", "/some/where", "--docs", "--out=/x"]) == ["--runs", "3", "--docs"]


def test_quick_bounds_scenarios_only_on_the_tiny_models_it_is_sized_for():
    # a --quick run on tiny-hybrid-wide took longer than the bound and reported "stuck"
    from tools.bench.cli import QUICK_SCENARIO_DEADLINE_S, quick_deadline

    assert quick_deadline(True, "tiny") == quick_deadline(True, "tiny-a") == QUICK_SCENARIO_DEADLINE_S
    assert quick_deadline(True, "tiny-hybrid-wide") is None and quick_deadline(True, "gemma-270m") is None
    assert quick_deadline(False, "tiny") is None


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


def test_the_pairs_alternate_strictly_so_every_request_follows_the_other_servers(monkeypatch):
    """A B A B: every request after the warm-ups comes right after one of the other server's.
    A rotating order (A B, B A) had each server answer twice in a row, the first after the
    other server and the second after itself: a short answer's time differs by milliseconds
    between the two, and the pairs' ratios split in two."""
    import asyncio
    import types

    from tools.bench import vs_llama_server as vs

    served: list[str] = []

    class Server:
        def __init__(self, variant):
            self.base = variant

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def answer(base, **fields):
        served.append(base)
        return {"decode_tok_s": 1.0, "ttft_ms": 1.0, "ms": 1.0, "tok_s": 1.0, "finish": "length", **fields}

    async def completion(http, base, prompt, max_tokens):
        return answer(base)

    async def chat(http, base, n, max_tokens):
        return answer(base)

    async def at_once(http, base, numbers, max_tokens, use_chat=False):
        return answer(base, finish=["length"] * len(numbers))

    async def not_streamed(http, base, prompt, max_tokens):
        return answer(base)

    async def shared_document(http, base, n, limit):  # its /tokenize calls are not answers
        return "a document. "

    for name, fake in (("start", lambda variant, *a, **k: Server(variant)), ("completion", completion),
                       ("chat", chat), ("at_once", at_once), ("not_streamed", not_streamed),
                       ("shared_document", shared_document)):
        monkeypatch.setattr(vs, name, fake)
    for quick in (True, False):
        served.clear()
        ctx = types.SimpleNamespace(quick=quick, threads=2, pick=lambda full, q, quick=quick: q if quick else full)
        pairs = asyncio.run(asyncio.wait_for(vs.paired(ctx, None, "llama-server", "model.gguf", 8), 30))
        assert len(pairs["ttft"]) == (4 if quick else vs.TTFT_PAIRS) and len(pairs["four"]) == (1 if quick else 3)
        measured = served[2:]  # after each server's warm-up; the documents' unmeasured first questions too
        assert measured and all(a != b for a, b in zip(measured, measured[1:])), measured
