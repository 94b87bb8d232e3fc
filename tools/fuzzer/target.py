"""The target: where it is, whether it is loopback, and (``--spawn``) running it.

With ``--spawn 'CMD'`` the fuzzer starts the target itself, notices when it dies (exit code
or signal, recorded in the finding) and starts it again, like a boofuzz process monitor.
``{port}`` in CMD is replaced by the target port; with ``--target HOST:0`` a free port is
picked (again on every restart of a replay, never reused across runs). The target's
stdout/stderr go to ``target.log`` in the output directory.
"""
from __future__ import annotations

import asyncio
import ipaddress
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

from hydra_rpc.config import parse_hostport  # noqa: F401 - re-exported for the fuzzer
from typing import IO, Any

from .responses import set_nodelay


class TargetError(Exception):
    """The target cannot be reached or started (an infrastructure problem, not a finding)."""


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    addrs = {info[4][0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def describe_exit(returncode: int) -> dict[str, Any]:
    out: dict[str, Any] = {"returncode": returncode}
    if returncode < 0:
        try:
            out["signal"] = signal.Signals(-returncode).name
        except ValueError:
            out["signal"] = f"signal {-returncode}"
    return out


def exit_text(info: dict[str, Any]) -> str:
    return f"killed by {info['signal']}" if "signal" in info else f"exit code {info['returncode']}"


class Target:
    def __init__(self, host: str, port: int, spawn: str | None = None, log_dir: Path | None = None,
                 ready_timeout: float = 60.0):
        self.host = host
        self.port = port
        self.spawn = spawn
        self.log_dir = log_dir
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.exits: list[dict[str, Any]] = []  # every death we saw, in order
        # every restart, with why: {"reason", "exit" (how it had died) or "stopped" (how our
        # SIGTERM ended a still running one), "peak_rss_mib"}
        self.restarts: list[dict[str, Any]] = []
        self._log: IO[bytes] | None = None
        self._last_rss_kb: int | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # ------------------------------------------------------------------ process (spawn mode)
    async def start(self) -> None:
        if not self.spawn:
            return
        if self.port == 0:
            self.port = free_port(self.host)
        try:
            cmd = shlex.split(self.spawn.replace("{port}", str(self.port)))
        except ValueError as e:
            raise TargetError(f"could not start the --spawn command: {e} in {self.spawn!r}") from None
        if not cmd:
            raise TargetError("could not start the --spawn command: it is empty")
        if self._log is None:
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                self._log = open(self.log_dir / "target.log", "ab")
            else:
                self._log = open(os.devnull, "wb")
        self._log.write(f"\n=== start {self.starts + 1}: {' '.join(cmd)}\n".encode())
        self._log.flush()
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        except OSError as e:
            raise TargetError(f"could not start the --spawn command: {cmd[0]}: {e.strerror or e}") from None
        self.starts += 1
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                last = self.log_tail(1).strip()
                raise TargetError(f"could not start the --spawn command: it exited during start-up "
                                  f"({exit_text(describe_exit(self.proc.returncode))})"
                                  + (f"; its last line: {last[:300]}" if last else ""))
            try:
                r, w = await self.connect(0.5)
            except (OSError, TimeoutError):
                await asyncio.sleep(0.05)
                continue
            w.close()
            return
        raise TargetError(f"could not start the --spawn command: it did not accept connections on {self.address} "
                          f"within {self.ready_timeout:.0f} s (does it use {{port}}?)")

    def exit_info(self) -> dict[str, Any] | None:
        """How the spawned target died, or None while it runs (or when not spawned)."""
        if self.proc is None or self.proc.poll() is None:
            return None
        return describe_exit(self.proc.returncode)

    def peak_rss_kb(self) -> int | None:
        """The spawned target's peak resident set (VmHWM), where /proc tells (Linux)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        self._last_rss_kb = int(line.split()[1])
                        return self._last_rss_kb
        except (OSError, ValueError):
            return None
        return None

    def last_peak_rss_kb(self) -> int | None:
        """The peak RSS last read (a target that just died keeps the value read before)."""
        return self.peak_rss_kb() or self._last_rss_kb

    @property
    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    async def restart(self, reason: str = "") -> None:
        if not self.spawn:
            return
        info = self.exit_info()
        record: dict[str, Any] = {"reason": reason or "restart"}
        rss = self.peak_rss_kb()
        if rss is not None:
            record["peak_rss_mib"] = rss // 1024
        elif self._last_rss_kb is not None:
            record["peak_rss_mib"] = self._last_rss_kb // 1024  # the last we read before it died
        if info is not None:
            self.exits.append(info)
            record["exit"] = info
        stopped = await self.stop()
        if info is None and stopped is not None:
            record["stopped"] = stopped
        self.restarts.append(record)
        await self.start()

    async def ensure_running(self, reason: str = "") -> bool:
        """Spawn mode: start it again if it died. Returns True if a restart happened."""
        if self.spawn and not self.alive:
            await self.restart(reason or "it was found dead before the next case")
            return True
        return False

    async def stop(self) -> dict[str, Any] | None:
        """Stop the spawned target; how it ended when we had to stop it (None: it was not running)."""
        p = self.proc
        if p is None:
            return None
        how = None
        if p.poll() is None:
            how = "SIGTERM"
            try:
                os.killpg(p.pid, signal.SIGTERM)  # our own process group (start_new_session)
            except (ProcessLookupError, PermissionError):
                p.terminate()
            try:
                await asyncio.get_running_loop().run_in_executor(None, p.wait, 10)
            except subprocess.TimeoutExpired:
                how = "SIGKILL after SIGTERM was ignored for 10 s"
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
                await asyncio.get_running_loop().run_in_executor(None, p.wait, 5)
        self.proc = None
        self._last_rss_kb = None
        if how is None:
            return None
        return {"by": how, **(describe_exit(p.returncode) if p.returncode is not None else {})}

    async def close(self) -> None:
        await self.stop()
        if self._log is not None:
            self._log.close()
            self._log = None

    # ------------------------------------------------------------------ connections
    async def connect(self, timeout: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        r, w = await asyncio.wait_for(asyncio.open_connection(self.host, self.port, limit=1 << 20), timeout)
        set_nodelay(w)
        return r, w

    def log_offset(self) -> int | None:
        """How far target.log goes now (None: no log of the target's output to read)."""
        if not self.spawn or self.log_dir is None:
            return None
        try:
            return (self.log_dir / "target.log").stat().st_size
        except OSError:
            return None

    def log_since(self, offset: int, limit: int = 1 << 20) -> str:
        """What the target printed after ``offset`` (at most ``limit`` bytes)."""
        if self.log_dir is None:
            return ""
        try:
            with open(self.log_dir / "target.log", "rb") as f:
                f.seek(offset)
                return f.read(limit).decode("utf-8", "replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        if self.log_dir is None or not (self.log_dir / "target.log").exists():
            return ""
        with open(self.log_dir / "target.log", "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 16384))
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])
