"""Start a child process and wait for the line that says it is ready.

One helper for the test suite and the benchmarks: a thread reads the child's output from the
start (a chatty child never blocks on a full pipe), the lines are kept for error messages, and
readiness is a line matched against a pattern before a deadline — never a sleep. A child that
exits or stays silent raises :class:`SpawnError` with what it printed.

    with HydraServerProcess(["--model", "tiny"], http=False) as sp:
        ... sp.host, sp.port ...
"""
from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
HYDRA_LISTENING = re.compile(r"hydra-rpc listening on ([\d.]+):(\d+)")
HYDRA_HTTP = re.compile(r"hydra-rpc http on ([\d.]+):(\d+)")
GGML_RPC_READY = re.compile(r"HYDRA_GGML_RPC_READY ([\d.]+):(\d+)")  # what ``python -m hydra_rpc.ggml.child`` prints


class SpawnError(RuntimeError):
    """The child exited, or printed no ready line in time; the message holds its output."""


def child_env(extra: dict[str, str] | None = None, root: Path = ROOT) -> dict[str, str]:
    """The environment of every child: this checkout (or ``root``, another one) first on the
    import path, unbuffered output."""
    env = dict(os.environ)
    env.update(extra or {})
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class ChildProcess:
    """A child whose text output is pumped into ``lines``; :meth:`wait_for` reads them in order.

    By default stdout and stderr are merged. With ``binary_stdout`` stdout is kept apart as raw
    bytes (:meth:`stdout_bytes`) and ``lines`` are stderr's — for a child whose stdout is its
    product and stderr its log. ``keep_lines`` bounds the lines kept (None: all of them).
    ``root``: the checkout the child runs from (another tree's code: a before-and-after bench).
    """

    def __init__(self, cmd: list[str], label: str, *, env: dict[str, str] | None = None,
                 binary_stdout: bool = False, keep_lines: int | None = None, root: Path = ROOT):
        self.cmd, self.label = cmd, label
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE if binary_stdout else subprocess.STDOUT,
                                     env=child_env(env, root), cwd=root)
        self.lines: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self._count = 0  # lines read so far, kept or not
        self._cursor = 0  # the next line wait_for looks at
        self._eof = False
        self._changed = threading.Condition()
        self._stdout: list[bytes] = []
        text = self.proc.stderr if binary_stdout else self.proc.stdout
        self._pumps = [threading.Thread(target=self._pump_lines, args=(text,), name=f"pump-{label}", daemon=True)]
        if binary_stdout:
            self._pumps.append(threading.Thread(target=self._pump_bytes, name=f"pump-{label}-out", daemon=True))
        for t in self._pumps:
            t.start()

    def _pump_lines(self, pipe: IO[bytes]) -> None:
        for raw in pipe:
            with self._changed:
                self.lines.append(raw.decode("utf-8", "replace"))
                self._count += 1
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    def _pump_bytes(self) -> None:
        for chunk in iter(lambda: self.proc.stdout.read(65536), b""):
            self._stdout.append(chunk)

    def wait_for(self, pattern: re.Pattern[str], timeout: float = 60.0) -> re.Match[str]:
        """The first match of ``pattern`` in a line after the previous match; stops the child
        and raises SpawnError if it exits first or the deadline passes."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                first_kept = self._count - len(self.lines)
                self._cursor = max(self._cursor, first_kept)
                while self._cursor < self._count:
                    m = pattern.search(self.lines[self._cursor - first_kept])
                    self._cursor += 1
                    if m:
                        return m
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    break
                self._changed.wait(left)
        self.stop()
        why = "exited" if self._eof else f"printed no {pattern.pattern!r} within {timeout:.0f}s"
        raise SpawnError(f"{self.label} {why} ({' '.join(self.cmd[1:])}):\n{self.tail(60)}")

    @property
    def log(self) -> str:
        """Every line kept so far."""
        with self._changed:
            return "".join(self.lines)

    def tail(self, n: int = 40) -> str:
        with self._changed:
            return "".join(list(self.lines)[-n:])

    def stdout_bytes(self) -> bytes:
        """What a ``binary_stdout`` child wrote (complete once it has been stopped)."""
        return b"".join(self._stdout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, sig: int = signal.SIGINT, timeout: float = 20.0) -> int:
        """Signal the child (SIGINT: a clean shutdown), kill it after ``timeout``; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for t in self._pumps:
            t.join(5)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        return self.proc.returncode

    def __enter__(self) -> "ChildProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- memory and CPU of the child (Linux /proc) -----------------------------------------
    def _status_kib(self, key: str) -> int | None:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            pass
        return None

    def rss_kib(self) -> int | None:
        return self._status_kib("VmRSS")

    def peak_kib(self) -> int | None:
        """VmHWM: the peak RSS since start or since :meth:`reset_peak`."""
        return self._status_kib("VmHWM")

    def reset_peak(self) -> bool:
        """Reset VmHWM to the current RSS (``echo 5 > /proc/PID/clear_refs``, Linux ≥ 4.0)."""
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    def cpu_seconds(self) -> float | None:
        """User + system CPU time the child has used so far (/proc/PID/stat)."""
        return stat_cpu_seconds(Path(f"/proc/{self.pid}/stat"))

    def thread_cpu(self) -> dict[int, float]:
        """:func:`thread_cpu_seconds` of the child."""
        return thread_cpu_seconds(self.pid)


def stat_cpu_seconds(stat: Path) -> float | None:
    """User + system CPU time in a /proc ``stat`` file (a process's or one thread's)."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def schedstat_cpu_seconds(schedstat: Path) -> float | None:
    """Time on a CPU in a /proc ``schedstat`` file, to the nanosecond (the scheduler's own count,
    which ``stat``'s user + system time rounds down to clock ticks)."""
    try:
        return int(schedstat.read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """Each live thread's CPU time so far, by thread id (/proc/PID/task/TID/schedstat; ``stat``'s
    user + system time where a kernel has no schedstat).

    The main thread's id is ``pid``. In nanoseconds, not clock ticks: a thread of a short run
    that used less than a tick (10 ms) of CPU would read as having used none."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        task = Path(f"/proc/{pid}/task/{tid}")
        cpu = schedstat_cpu_seconds(task / "schedstat")
        if cpu is None:
            cpu = stat_cpu_seconds(task / "stat")
        if cpu is not None:
            out[int(tid)] = cpu
    return out


def cpu_used(before: dict[int, float], after: dict[int, float], *, skip: tuple[int, ...] = ()) -> float:
    """CPU seconds the threads of ``after`` (but those in ``skip``) used since ``before`` (a
    thread started in between counts from zero; one that ended in between is not counted)."""
    return sum(cpu - before.get(tid, 0.0) for tid, cpu in after.items() if tid not in skip)


class HydraServerProcess(ChildProcess):
    """``python -m hydra_rpc.cli serve --port 0 ARGS`` (or another module taking the same flags),
    ready once it printed its address — and its HTTP address unless ``http`` is False."""

    def __init__(self, args: list[str], *, http: bool = True, module: str = "hydra_rpc.cli serve",
                 label: str = "hydra-rpc server", timeout: float = 120.0, env: dict[str, str] | None = None,
                 keep_lines: int | None = None):
        cmd = [sys.executable, "-m", *module.split(), "--port", "0", *args]
        if http and "--http-port" not in args:
            cmd += ["--http-port", "0"]
        if not http and "--no-http" not in args:
            cmd += ["--no-http"]
        super().__init__(cmd, label, env=env, keep_lines=keep_lines)
        m = self.wait_for(HYDRA_LISTENING, timeout)
        self.host, self.port = m.group(1), int(m.group(2))
        self.http_port: int | None = int(self.wait_for(HYDRA_HTTP, timeout).group(2)) if http else None


class GgmlRpcServerProcess(ChildProcess):
    """llama.cpp's own ggml RPC server from the wheel (``python -m hydra_rpc.ggml.child``)."""

    def __init__(self, threads: int | None = None, *, timeout: float = 60.0, env: dict[str, str] | None = None):
        cmd = [sys.executable, "-m", "hydra_rpc.ggml.child", "--host", "127.0.0.1", "--port", "0"]
        if threads is not None:
            cmd += ["--threads", str(threads)]
        super().__init__(cmd, "ggml rpc server", env=env, keep_lines=200)
        m = self.wait_for(GGML_RPC_READY, timeout)
        self.host, self.port = m.group(1), int(m.group(2))

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, sig: int = signal.SIGINT, timeout: float = 5.0) -> int:
        # it blocks in C; SIGINT reaches Python's sleep loop, SIGKILL is the fallback
        return super().stop(sig, timeout)
