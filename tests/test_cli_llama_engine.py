"""``hydra-llama-engine`` as an operator meets it: free ports that stay free ports, every port
printed with its flag, and logs a fleet can live with (probes and OK requests at DEBUG, a
periodic summary at INFO, llama-server's -v/-lv mapped onto --log-level)."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from hydra_rpc.cli.llama_argv import InvalidArgument, parse_llama_argv
from hydra_rpc.cli.llama_engine import hydra_port, split_own_args
from hydra_rpc.cli.usage import UsageError
from tools.spawn import HYDRA_HTTP, HYDRA_LISTENING, ChildProcess

SUMMARY = re.compile(r"summary .*hydra_requests=(\d+) http_requests=(\d+) errors=(\d+) .*slots_busy=(\d+)/(\d+)")
SUMMARY_JSON = re.compile(r'"msg": "summary", .*"hydra_requests": (\d+), "http_requests": (\d+), "errors": (\d+)')


def engine(*args: str) -> ChildProcess:
    cmd = [sys.executable, "-m", "hydra_rpc.cli.llama_engine", "--host", "127.0.0.1", "-m", "tiny", *args]
    return ChildProcess(cmd, "hydra-llama-engine", keep_lines=None)


def _ports(p: ChildProcess) -> tuple[int, int]:
    hydra = p.wait_for(HYDRA_LISTENING, 120)
    http = p.wait_for(HYDRA_HTTP, 120)
    return int(hydra.group(2)), int(http.group(2))


def _get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _call(port: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "call", *args, "--target", f"127.0.0.1:{port}"],
                          capture_output=True, timeout=60)


def _until_counted(p: ChildProcess, hydra: int, http: int, timeout: float = 30.0,
                   pattern: re.Pattern[str] = SUMMARY) -> tuple[int, int, int]:
    """Sum the summary lines until they count at least ``hydra`` and ``http`` requests."""
    got = [0, 0, 0]
    deadline = time.monotonic() + timeout
    while got[0] < hydra or got[1] < http:
        m = p.wait_for(pattern, max(0.1, deadline - time.monotonic()))
        got = [got[i] + int(m.group(i + 1)) for i in range(3)]
    return got[0], got[1], got[2]


@pytest.mark.parametrize("argv, want", [
    (["--port", "0"], 0),  # was 0 + 1 = port 1, a privileged port
    (["--port", "8080"], 8081),  # llama-engine's default rule stays
    (["--port", "0", "--rpc-port", "9000"], 9000),
    (["--port", "8080", "--rpc-port", "0"], 0),  # an explicit free port
])
def test_hydra_port_defaults_never_land_on_port_1(argv, want):
    assert hydra_port(parse_llama_argv(argv, {})) == want


def test_port_65535_leaves_no_room_for_the_hydra_port():
    with pytest.raises(UsageError, match="--rpc-port"):
        hydra_port(parse_llama_argv(["--port", "65535"], {}))


def test_log_arguments_map_onto_the_level_and_leave_the_rest():
    opts, rest, env = split_own_args(["--reverse-prompt", "-v", "-c", "256", "-lv", "2", "--log-format=json"],
                                     {"LLAMA_ARG_LOG_VERBOSITY": "5", "HOME": "/x"})
    assert (opts.level, opts.format) == ("WARNING", "json")  # the command line over the environment
    assert rest == ["--reverse-prompt", "-v", "-c", "256"]  # "-v" here is --reverse-prompt's value
    assert env == {"HOME": "/x"}
    assert split_own_args(["--verbose"], {})[0].level == "DEBUG"
    assert split_own_args(["-lv", "4"], {})[0].level == "DEBUG"
    assert split_own_args(["--log-level", "error"], {})[0].level == "ERROR"


def test_loop_priority_is_taken_out_and_reaches_the_engine_config(monkeypatch, tiny_model_path):
    """``--loop-priority`` is hydra-rpc's own, as in ``hydra-rpc serve``: realtime unless told."""
    import hydra_rpc.app
    from hydra_rpc.cli import llama_engine as cmd

    assert split_own_args(["-c", "256"], {})[0].loop_realtime is True
    opts, rest, _ = split_own_args(["--loop-priority", "normal", "-c", "256"], {})
    assert (opts.loop_realtime, rest) == (False, ["-c", "256"])
    assert split_own_args(["--loop-priority=realtime"], {})[0].loop_realtime is True
    with pytest.raises(InvalidArgument, match="expected realtime or normal"):
        split_own_args(["--loop-priority", "high"], {})
    made = {}
    monkeypatch.setattr(hydra_rpc.app, "App", lambda server, engine, **kw: made.setdefault("engine", engine))
    monkeypatch.setattr(cmd, "announce_ignored", lambda s, prog: None)
    monkeypatch.setattr(cmd, "apply_process_priority", lambda s: None)
    for realtime in (True, False):
        cmd.build_app(parse_llama_argv(["--model", tiny_model_path], {}), realtime)
        assert made.pop("engine").loop_realtime is realtime


def test_bad_log_level_is_refused_like_llama_server_refuses():
    r = subprocess.run([sys.executable, "-m", "hydra_rpc.cli.llama_engine", "-m", "tiny", "--log-level", "LOUD"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and 'argument "--log-level": unknown level' in r.stderr


def test_port_0_gives_two_free_ports_each_printed_with_its_flag(tiny_model_path):
    with engine("--port", "0", "--log-summary", "0") as p:
        hydra, http = _ports(p)
        assert hydra > 1024 and http > 1024 and hydra != http
        assert re.search(rf"listening on 127\.0\.0\.1:{hydra} \(Hydra port, --rpc-port\)", p.log), p.log
        assert re.search(rf"http on 127\.0\.0\.1:{http} \(HTTP, --port\)", p.log), p.log
        # the hint follows the port lines: wait for it, the child may not have printed it yet
        p.wait_for(re.compile(re.escape(f"hydra-rpc call INFO --target 127.0.0.1:{hydra}")), 60)
        for port in (hydra, http):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        assert _call(hydra, "INFO").returncode == 0


def test_probes_and_ok_requests_are_debug_and_a_summary_counts_them(tiny_model_path):
    with engine("--port", "0", "--log-summary", "0.2", "--log-format", "json") as p:
        hydra, http = _ports(p)
        for path in ("/health", "/slots", "/slots"):
            _get(http, path)
        assert _call(hydra, "INFO").returncode == 0
        assert _call(hydra, "STATE_META", "--key=-1").returncode == 1  # NOT_FOUND: not routine
        n_hydra, n_http, errors = _until_counted(p, hydra=2, http=3, pattern=SUMMARY_JSON)
        assert (n_hydra, n_http, errors) == (2, 3, 1)
        records = [json.loads(line) for line in p.log.splitlines() if line.strip()]  # every line is JSON
        requests = [r for r in records if r["msg"] in ("request", "http")]
        assert [(r["level"], r["status"]) for r in requests] == [("INFO", "NOT_FOUND")], requests
        summary = next(r for r in records if r["msg"] == "summary")
        assert summary["level"] == "INFO" and {"tokens", "prompt_tokens", "slots_busy"} <= set(summary)
        assert not [r for r in records if r.get("logger") == "engine.llama_cpp"]  # llama.cpp's lines: verbose only


def test_verbose_shows_every_request(tiny_model_path):
    with engine("--port", "0", "--log-summary", "0.2", "-lv", "5") as p:
        hydra, http = _ports(p)
        _get(http, "/slots")
        assert _call(hydra, "INFO").returncode == 0
        _until_counted(p, hydra=1, http=1)
        assert re.search(r" DEBUG hydra_rpc\.http: http method=GET path=/slots status=\d+", p.log), p.log
        assert re.search(r" DEBUG hydra_rpc: request op=INFO .*status=OK", p.log), p.log
        # llama.cpp's own lines too, as llama-server shows them when verbose, in the server's format
        assert re.search(r" DEBUG engine\.llama_cpp: llama_context: n_ctx\s+= \d+$", p.log, re.M), p.log


def test_serve_port_0_makes_the_http_port_free_too(tiny_model_path):
    cmd = [sys.executable, "-m", "hydra_rpc.cli", "serve", "--model", "tiny", "--port", "0"]
    with ChildProcess(cmd, "serve") as first, ChildProcess(cmd, "serve") as second:
        ports = [_ports(first), _ports(second)]  # the second would fail on 8080 if it were the default
        assert len({*ports[0], *ports[1]}) == 4 and 8080 not in {*ports[0], *ports[1]}
        assert re.search(r"listening on [\d.]+:\d+ \(Hydra port, --port\)", first.log)
        assert re.search(r"http on [\d.]+:\d+ \(HTTP, --http-port\)", first.log)


@pytest.mark.parametrize("argv, said", [
    (["-np", "4", "-b", "2"], "a batch of 2 tokens (--batch-size) cannot hold a token of each of the 4 slots"),
    (["-np", "4", "-c", "1"], "a batch of 1 tokens (--ctx-size) cannot hold a token of each of the 4 slots"),
])
def test_a_batch_smaller_than_the_slots_is_refused_not_aborted(tiny_model_path, argv, said):
    """llama.cpp caps n_batch at n_ctx, reserves an output row per sequence within it and aborts
    the process when they do not fit (llama-server dies of SIGABRT): the engine says which
    argument, status 1."""
    cmd = [sys.executable, "-m", "hydra_rpc.cli.llama_engine", "--host", "127.0.0.1", "-m", "tiny", "--port", "0",
           *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert said in done.stderr and "GGML_ASSERT" not in done.stderr


def test_a_configure_asking_for_a_context_too_small_for_the_slots_is_refused(tiny_model_path):
    """The same limit on the Hydra port: a CONFIGURE of n_ctx 1 with four slots once killed the
    process from the shadow model's build; it is refused with the reason and the old model serves."""
    with engine("--port", "0", "--log-summary", "0", "-np", "4") as p:
        hydra, http = _ports(p)
        done = _call(hydra, "CONFIGURE", "--json", '{"n_ctx": 1}')
        assert done.returncode == 1, done.stderr  # a CONFIGURE that applied none of its keys
        meta = json.loads(done.stdout[done.stdout.index(b"{"):])
        assert "cannot hold a token of each of the 4 slots" in meta["rejected_keys"]["n_ctx"], meta
        assert meta["deferred_keys"] == [] and p.proc.poll() is None
        assert _call(hydra, "INFO").returncode == 0 and _get(http, "/health") == 200


YARN_TO_NOTHING = ["--rope-scaling", "yarn", "--rope-scale", "1e-6"]  # training context / 1e6: 0 tokens


def test_a_rope_scale_that_leaves_slots_no_context_is_refused_at_start(tiny_model_path):
    """llama.cpp divides the model's training context by the RoPE scale: an extreme one left
    every slot 0 tokens, every prompt refused (llama-server aborts on its first request). The
    engine refuses to start on it and says why."""
    cmd = [sys.executable, "-m", "hydra_rpc.cli.llama_engine", "--host", "127.0.0.1", "-m", "tiny", "--port", "0",
           *YARN_TO_NOTHING]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "a slot would hold 0 tokens" in done.stderr and "--rope-scale" in done.stderr


def test_a_configure_whose_rope_scale_leaves_slots_no_context_fails_its_reload(tiny_model_path):
    """The same settings by CONFIGURE: the shadow model is refused, the reload fails with the
    reason, and the old model goes on answering prompts."""
    with engine("--port", "0", "--log-summary", "0", "-np", "2") as p:
        hydra, http = _ports(p)
        done = _call(hydra, "CONFIGURE", "--json", '{"rope_scaling": "yarn", "rope_scale": 1e-6}')
        assert done.returncode == 0, done.stderr
        assert sorted(json.loads(done.stdout[done.stdout.index(b"{"):])["deferred_keys"]) == ["rope_scale",
                                                                                            "rope_scaling"]
        deadline = time.monotonic() + 60
        while (health := _get_json(http, "/health"))["reload"] in ("loading", "draining"):  # pending
            assert time.monotonic() < deadline, health
            time.sleep(0.05)
        assert health["reload"] == "failed" and health["config_generation"] == 1, health
        info = _call(hydra, "INFO")
        assert b"a slot would hold 0 tokens" in info.stdout, info.stdout[-2000:]
        body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] >= 1


def _get_json(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return json.loads(r.read())


def test_no_jinja_with_a_template_llama_cpp_does_not_know_fails_each_chat_as_llama_server_does():
    """``--no-jinja`` leaves only llama.cpp's built-in formats, and tiny-hybrid's template is
    none of them: llama-server starts and answers each chat 500 "this custom template is not
    supported, try using --jinja". So does this engine, on both ports, with no traceback; a
    plain completion is served."""
    cmd = [sys.executable, "-m", "hydra_rpc.cli.llama_engine", "--host", "127.0.0.1", "-m", "tiny-hybrid",
           "--port", "0", "--log-summary", "0", "--no-jinja"]
    with ChildProcess(cmd, "hydra-llama-engine", keep_lines=None) as p:
        hydra, http = _ports(p)
        chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/chat/completions", chat,
                                     {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 500 and "try using --jinja" in json.loads(e.value.read())["error"]["message"]
        done = _call(hydra, "PREFILL", "--key", "0", "--json", '{"messages": [{"role": "user", "content": "hi"}]}')
        assert b"ERROR" in done.stderr and b"try using --jinja" in done.stdout, (done.stdout, done.stderr)
        plain = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions",
                                       json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
                                       {"Content-Type": "application/json"})
        with urllib.request.urlopen(plain, timeout=30) as r:
            assert r.status == 200
        assert "Traceback" not in p.log and "internal error" not in p.log, p.log[-3000:]
