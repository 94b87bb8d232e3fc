"""``hydra-rpc call`` against a real server: meta JSON on stdout, status and summary on stderr,
--out, -v with decoded headers, and --describe examples that really work."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import start_server

REPO = Path(__file__).resolve().parent.parent
USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server(tiny_model_path):
    sp = start_server("--model", "tiny", "--no-http", "--log-level", "WARNING")
    yield sp
    assert sp.stop() == 0, sp.log


def call(server, *args: str, cwd: Path = REPO, data: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "call", *args, "--target",
                           f"{server.host}:{server.port}"], capture_output=True, timeout=60, cwd=cwd, input=data)


def test_info_meta_is_json_on_stdout_status_on_stderr(server):
    r = call(server, "INFO")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["engine"] == "llama-server-hydra" and info["model_name"]
    assert r.stderr.decode().splitlines()[0] == "OK (0x00)"
    assert b"payload: 0 bytes" in r.stderr


def test_non_ok_reply_exits_1_with_its_meta_on_stdout(server):
    r = call(server, "STATE_META", "--key=-1")  # a negative slot (a larger one maps modulo the slots)
    assert r.returncode == 1 and b"NOT_FOUND" in r.stderr
    assert "error" in json.loads(r.stdout)


def test_prefill_out_state_put_round_trip_and_pin_stream(server, tmp_path):
    blob = tmp_path / "slot0.kv"
    r = call(server, "PREFILL", "--key", "0", "--json", json.dumps({"messages": USER}), "--out", str(blob))
    assert r.returncode == 0, r.stderr
    meta = json.loads(r.stdout)
    assert meta["n_past"] > 0 and meta["kv_hash_str"].startswith("xxh3:")
    assert blob.stat().st_size == int(re.search(rb"payload: (\d+) bytes", r.stderr).group(1)) > 0
    r = call(server, "STATE_PUT", "--key", "1", "--payload-file", str(blob))
    assert r.returncode == 0, r.stderr
    r = call(server, "STATE_META", "--key", "1")
    assert json.loads(r.stdout)["n_past"] == meta["n_past"]
    r = call(server, "DECODE", "--key", "1", "--json", '{"n_predict":5,"messages":null}')
    assert r.returncode == 0 and b"[5 tokens streamed]" in r.stderr and r.stdout.strip()


def test_out_saves_the_meta_of_a_meta_only_reply(server, tmp_path):
    out = tmp_path / "meta.json"
    r = call(server, "STATE_META", "--key", "0", "--out", str(out))
    assert r.returncode == 0 and json.loads(out.read_text()) == json.loads(r.stdout)


def test_out_is_untouched_by_an_error_reply(server, tmp_path):
    """A typo (STATE_GET of a slot that does not exist) must not destroy a saved KV file."""
    out = tmp_path / "slot0.kv"
    out.write_bytes(b"precious KV state")
    r = call(server, "STATE_GET", "--key=-1", "--out", str(out))
    assert r.returncode == 1 and b"NOT_FOUND" in r.stderr
    assert out.read_bytes() == b"precious KV state"
    assert f"not saved: the reply is NOT_FOUND, not OK; {out} is left untouched".encode() in r.stderr
    assert list(tmp_path.iterdir()) == [out]  # no temporary file left behind either


def test_configure_that_applied_nothing_exits_1_naming_the_keys(server):
    r = call(server, "CONFIGURE", "--json", '{"temp":"hot","no_such_key":1}')
    assert r.returncode == 1 and b"OK (0x00)" in r.stderr, r.stderr
    err = r.stderr.decode()
    assert "CONFIGURE applied none of its keys:" in err and "rejected temp:" in err
    assert "unrecognized no_such_key" in err
    r = call(server, "CONFIGURE", "--json", '{"temp":0.7,"no_such_key":1}')  # one applied: a change was made
    assert r.returncode == 0 and "sampling.temp" in json.loads(r.stdout)["params_applied"], r.stderr
    assert call(server, "CONFIGURE", "--json", "{}").returncode == 0  # nothing asked, nothing refused


def test_verbose_shows_both_headers_decoded(server):
    r = call(server, "INFO", "-v", "--trace", "tr-1")
    err = r.stderr.decode()
    assert "> header  59 48 41 00" in err
    assert "magic=0x4859 op=0x41(INFO) flags=0 key_len=0 payload_len=0 trace_len=4" in err
    assert "> trace   b'tr-1'" in err
    meta_len = len(r.stdout.strip()) and json.loads(r.stdout)
    assert re.search(r"< header  00 [0-9a-f ]+\n<\s+status=0x00\(OK\) meta_len=\d+ payload_len=0", err), err
    assert meta_len


def test_describe_lists_four_decode_dialects_and_call_op_help_too(server):
    d = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "call", "--describe", "DECODE"], capture_output=True,
                       text=True, timeout=60, check=True).stdout
    for dialect in ("PIN", "frames", "E1", "v3"):
        assert re.search(rf"^  {dialect}\s", d, re.M), d
    h = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "call", "DECODE", "--help"], capture_output=True,
                       text=True, timeout=60, check=True).stdout
    assert "usage: hydra-rpc call" in h and d.strip() in h
    c = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "call", "--describe", "CONFIGURE"],
                       capture_output=True, text=True, timeout=60, check=True).stdout
    assert all(re.search(rf"^  {t}\s", c, re.M) for t in ("T1", "T2", "T3", "T4")) and "sampling.temp" in c


def _examples(text: str) -> list[str]:
    """The shell commands of a --describe text (a command may continue over several lines)."""
    out, cur = [], ""
    for line in text.splitlines():
        s = line.strip()
        if cur:
            cur += "\n" + s
        elif s.startswith(("hydra-rpc call", f"{shlex.quote(sys.executable)} -c")):
            cur = s
        else:
            continue
        if (not cur.endswith("\\") and cur.count("'") % 2 == 0):
            out.append(cur)
            cur = ""
    return out


@pytest.mark.parametrize("op", ["DECODE", "PREFILL", "STATE_GET", "CONFIGURE", "SET_EXPERT_MODE"])
def test_describe_examples_work_against_the_server(server, tmp_path, op):
    text = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "call", "--describe", op], capture_output=True,
                          text=True, timeout=60, check=True).stdout
    # the v3 example reads a saved state: make one first
    assert call(server, "PREFILL", "--key", "0", "--json", '{"prompt":"hello"}', "--out",
                str(tmp_path / "slot0.kv")).returncode == 0
    hydra = f"{shlex.quote(sys.executable)} -m hydra_rpc.cli call --target {server.host}:{server.port}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    commands = _examples(text)
    assert commands, text
    assert "python -c" not in text.replace(f"{sys.executable} -c", ""), "examples must name the venv's interpreter"
    for cmd in commands:
        r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd.replace("hydra-rpc call", hydra)],
                           capture_output=True, timeout=60, cwd=tmp_path, env={**env, "PATH": "/usr/bin:/bin"})
        if '"cache_type_k":"q8_0"' in cmd:  # the tiny model's 16-element heads cannot hold q8_0's 32-blocks
            assert r.returncode == 1 and b"CONFIGURE applied none of its keys" in r.stderr, (cmd, r.stderr)
            assert b"needs attention heads of a multiple of 32" in r.stderr, r.stderr
            continue
        assert r.returncode == 0 and b"OK (0x00)" in r.stderr, (cmd, r.stdout, r.stderr)


def test_the_default_model_banner_commands_work(server, tmp_path):
    """The commands `serve` prints for the base model (checked here on the tiny model)."""
    from hydra_rpc.cli.serve import BASE_MODEL_BANNER

    from hydra_rpc.cli.serve import target_flag

    assert "BASE model" in BASE_MODEL_BANNER and "--model PATH" in BASE_MODEL_BANNER
    assert target_flag("127.0.0.1", 9503) == ""  # call's default target needs no flag
    commands = _examples(BASE_MODEL_BANNER.format(target=target_flag(server.host, server.port)))
    assert [c.split()[2] for c in commands] == ["PREFILL", "DECODE"]
    assert all(f"--target {server.host}:{server.port}" in c for c in commands), commands
    hydra = f"{shlex.quote(sys.executable)} -m hydra_rpc.cli call"
    for cmd in commands:
        r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd.replace("hydra-rpc call", hydra)],
                           capture_output=True, timeout=60, cwd=tmp_path)
        assert r.returncode == 0 and b"OK (0x00)" in r.stderr, (cmd, r.stderr)
