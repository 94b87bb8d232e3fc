import subprocess
import sys


def test_cli_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for name in ("serve", "call", "inspect", "fuzz", "bench"):
        assert name in out


def test_header_codec_bench_runs():
    import json

    out = subprocess.run([sys.executable, "-m", "tools.bench.header_codec", "--rounds", "1", "--n", "2000"],
                         capture_output=True, text=True, check=True).stdout
    cases = json.loads(out)["cases"]
    assert set(cases) == {"request decode", "request encode", "response decode", "response encode"}
    assert all(c["rounds"][0]["struct_us"] > 0 and c["rounds"][0]["construct_us"] > 0 for c in cases.values())


def test_thread_wake_bench_runs_every_setting(tmp_path):
    import json

    out = tmp_path / "wake.json"
    subprocess.run([sys.executable, "-m", "tools.bench.thread_wake", "--steps", "30", "--work-ms", "0.2",
                    "--out", str(out)], capture_output=True, text=True, check=True, timeout=120)
    settings = json.loads(out.read_text())["settings"]
    assert set(settings) == {"free", "one_cpu", "other_cpu_busy"}
    for figures in settings.values():  # every exchange was timed, each step its two hand-offs
        assert set(figures) == {"hand_back_us", "submit_us"}
        assert all(0 < f["p10"] <= f["median"] <= f["p90"] for f in figures.values())


def test_idle_decode_bench_times_every_setting_against_its_back_to_back_decode(tmp_path):
    import json

    out = tmp_path / "idle.json"
    subprocess.run([sys.executable, "-m", "tools.bench.idle_decode", "--model", "tiny-a", "--threads", "1,2",
                    "--gaps", "0,1", "--busy-before", "0,50", "--tokens", "3", "--decodes", "5", "--out", str(out)],
                   capture_output=True, text=True, check=True, timeout=120)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["threads"], r["gap_ms"], r["busy_before_us"]) for r in rows] == [
        (t, g, b) for t in (1, 2) for g in (0.0, 1.0) for b in (0.0, 50.0)]
    for r in rows:
        assert 0 < r["p10"] <= r["median"] <= r["p90"]
        base = next(b for b in rows if b["threads"] == r["threads"])  # each thread count's back-to-back
        assert r["ratio"] == round(r["median"] / base["median"], 3)
    assert result["tokens"] == 3 and result["machine"]["git_commit"]


def test_sigint_stops_a_command_started_with_sigint_ignored():
    """A script's background job starts with SIGINT ignored: ``kill -INT`` must still stop it."""
    import signal
    import time

    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    with subprocess.Popen([sys.executable, "-m", "hydra_rpc.cli", "inspect", "-"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=ignore_sigint) as p:
        try:
            p.stdin.write(bytes.fromhex("d4c3b2a1"))  # a pcap's magic: it now waits for the rest
            p.stdin.flush()
            deadline = time.monotonic() + 60  # only turns a hang into a failure
            while p.poll() is None and time.monotonic() < deadline:
                p.send_signal(signal.SIGINT)  # repeated: the first may come before it reads
                try:
                    p.wait(0.5)
                except subprocess.TimeoutExpired:
                    pass
            assert p.returncode is not None, "inspect ignored SIGINT"
        finally:
            p.kill()
