"""llama-server for ``vs-llama-server``: found in (or built into) the wheel cache, and started.

The binary comes from ``scripts/build_llama_server.sh``: llama.cpp as vendored in the
llama-cpp-python sdist of the *installed* wheel's version, the wheel's ``CMAKE_ARGS`` (plus
``-DLLAMA_CURL=OFF`` and what builds offline), cached next to the wheel under
``~/.cache/llama-cpp-wheels/<version>-<key>-llama-server/`` with the wheel's key. Built once
(about 10 minutes on 2 cores); a full bench run builds it when missing, a ``--quick`` run does
not (it reports the scenario skipped, with the command that builds it).

Environment:

* ``HYDRA_BENCH_LLAMA_SERVER=PATH``: use this binary (no build, no cache);
* ``HYDRA_BENCH_BUILD_LLAMA_SERVER=1|0``: build when missing even with ``--quick`` / never build;
* ``LCP_SDIST_DIR``, ``LCP_CMAKE_ARGS``, ``LCP_WHEEL_CACHE``: passed to the build script.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from tools.spawn import ROOT, ChildProcess

from .common import BenchError

BUILD_SCRIPT = ROOT / "scripts" / "build_llama_server.sh"
BUILD_HINT = "scripts/build_llama_server.sh"
BUILD_TIMEOUT_S = 3600.0


def _script_env() -> dict[str, str]:
    env = dict(os.environ)
    try:  # the version of the wheel actually installed, whatever the script's default
        import llama_cpp

        env.setdefault("LCP_VERSION", llama_cpp.__version__)
    except Exception:  # pragma: no cover - the bench needs llama_cpp anyway
        pass
    env.setdefault("PYTHON", sys.executable)
    return env


def expected_path() -> Path:
    """Where the cached binary is, or would be once built."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--path"], capture_output=True, text=True, timeout=30,
                         env=_script_env(), check=True)
    return Path(out.stdout.strip())


def find_or_build(allow_build: bool, log_path: Path | None = None) -> tuple[Path | None, str]:
    """(the binary, "") — or (None, why there is none), the reason phrased for a report."""
    override = os.environ.get("HYDRA_BENCH_LLAMA_SERVER")
    if override:
        p = Path(override)
        return (p, "") if p.is_file() and os.access(p, os.X_OK) else (None, f"HYDRA_BENCH_LLAMA_SERVER={p} "
                                                                           "is not an executable file")
    if not BUILD_SCRIPT.is_file():
        return None, f"{BUILD_HINT} is missing"
    try:
        path = expected_path()
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{BUILD_HINT} --path failed: {e}"
    if path.is_file() and os.access(path, os.X_OK):
        return path, ""
    force = os.environ.get("HYDRA_BENCH_BUILD_LLAMA_SERVER")
    if force == "0" or (not allow_build and force != "1"):
        return None, f"not built: run {BUILD_HINT} to build it"
    print(f"hydra-rpc bench: building llama-server into {path.parent} (once; about 10 minutes on 2 cores)",
          file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        done = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, env=_script_env(),
                              timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"the build ({BUILD_HINT}) took more than {BUILD_TIMEOUT_S:.0f} s"
    if log_path is not None:
        log_path.write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not (path.is_file() and os.access(path, os.X_OK)):
        tail = " / ".join(ln.strip() for ln in done.stderr.strip().splitlines()[-3:])
        return None, f"the build failed (exit {done.returncode}): {tail[:400]}"
    print(f"hydra-rpc bench: llama-server built in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return path, ""


def llama_server_or_exit() -> Path:
    """A standalone bench's llama-server (built beside the wheel); exits saying why there is none."""
    binary, reason = find_or_build(False)
    if binary is None:
        raise SystemExit(f"no llama-server: {reason}")
    return binary


@contextlib.contextmanager
def servers_running(starts: dict[str, Callable[[], "OpenAIServer"]]) -> Iterator[dict[str, "OpenAIServer"]]:
    """Start each server in turn (each is up when its start returns) and stop every one started,
    also when a later one fails to start."""
    up: dict[str, OpenAIServer] = {}
    try:
        for name, start in starts.items():
            up[name] = start()
        yield up
    finally:
        for srv in up.values():
            srv.stop()


def build_info(binary: Path) -> str:
    info = binary.parent / "BUILD_INFO"
    return info.read_text().strip() if info.is_file() else ""


class OpenAIServer(ChildProcess):
    """A server process (llama-server, or ours through ``hydra-llama-engine``) on a known HTTP
    port; ready once ``GET /health`` answers 200 (both answer 503 while the model loads)."""

    def __init__(self, cmd: list[str], port: int, label: str, timeout: float = 180.0, root: Path = ROOT):
        super().__init__(cmd, label, keep_lines=300, root=root)
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise BenchError(f"{label} exited ({' '.join(cmd)}):\n{self.tail(40)}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise BenchError(f"{label} not ready within {timeout:.0f} s ({' '.join(cmd)}):\n{self.tail(40)}")
            time.sleep(0.1)


def thread_names(pid: int) -> dict[int, str]:
    out = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                out[int(tid)] = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            except OSError:
                pass
    except OSError:
        pass
    return out
