"""``--ggml-rpc-embedded``: llama.cpp's ggml RPC server as supervised child processes.

llama.cpp's rpc-server aborts its process on malformed input and serves one client at a time,
so it never runs in ours: each ggml session gets a child of its own (hydra_rpc/ggml/child.py),
started before it is needed (a warm spare) and killed when the session ends, which also gives
back every byte the session made the server allocate. A crash ends that one session; the pool
starts the next child, backing off while children keep failing to start.

How a child becomes a session's upstream ("sealing"): it listens on a random 127.0.0.1 port;
we connect and complete a HELLO; it then shuts its listening socket down and reports how many
connections its server accepted. Exactly one — ours — or the child is discarded. So the port is
reachable only between the child's ``listen()`` and our connection (milliseconds, random
port, before any client exists), and a process that got in first is detected, never served
through. Residual risk (docs/ggml.md): a local process that wins that race reaches an unguarded
rpc-server — in a child that is then killed unused — as our user.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, field

from codec import ggml as G
from engine.ggml_rpc_lib import open_session

log = logging.getLogger("hydra_rpc.ggml_children")
ENGINE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_TIMEOUT = 20.0  # seconds from spawn to sealed
BACKOFF_FIRST, BACKOFF_MAX = 0.1, 10.0
# The server prints this when its accept fails on the sealed listener: the normal end of a session.
_EXPECTED_STDERR = (b"Failed to accept client connection",)


@dataclass(eq=False)
class GgmlChild:
    proc: asyncio.subprocess.Process
    sock: socket.socket  # blocking, connected to the child's server, HELLO done
    hello: G.HelloResponse
    tasks: list[asyncio.Task] = field(default_factory=list)
    released: bool = False  # the session is over and we sent SIGKILL: that exit is not a crash

    @property
    def pid(self) -> int:
        return self.proc.pid


class ChildStartError(RuntimeError):
    pass


class GgmlChildPool:
    """Children for at most ``max_sessions`` sessions at once, ``spares`` of them started ahead.

    Every change of ``_idle``/``_busy``/``_starting`` happens under ``_changed``; spawning
    happens outside it."""

    def __init__(self, threads: int, max_sessions: int, spares: int = 1, command: list[str] | None = None):
        # -m from ENGINE_DIR (cwd and PYTHONPATH): an "engine" directory wherever the server was
        # started from must not be what runs
        self.command = command or [sys.executable, "-m", "hydra_rpc.ggml.child", "--sealed", "--threads", str(threads)]
        self.threads = threads
        self.max_sessions = max_sessions
        self.spares = min(spares, max_sessions)
        self.stats = {"started": 0, "failed_starts": 0, "crashed": 0, "intruders": 0, "refused_busy": 0}
        self.start_ms: list[float] = []  # spawn → sealed of the last children (the bench reports it)
        self._idle: list[GgmlChild] = []
        self._busy: set[GgmlChild] = set()
        self._ending: set[GgmlChild] = set()  # released, killed, not yet reaped: close() waits for them
        self._starting = 0
        self._changed = asyncio.Condition()
        self._filler: asyncio.Task | None = None
        self._closed = False

    @property
    def spares_ready(self) -> int:
        return len(self._idle)

    @property
    def _live(self) -> int:
        return len(self._idle) + len(self._busy) + self._starting

    async def start(self) -> None:
        """Have the first spare ready (a broken install fails at startup), then keep spares."""
        self._idle.append(await self._spawn())
        self._filler = asyncio.create_task(self._fill(), name="ggml-child-pool")

    async def acquire(self, timeout: float) -> GgmlChild | None:
        """A sealed child for one session; None if ``max_sessions`` stay busy for ``timeout`` s."""
        async with self._changed:
            try:
                async with asyncio.timeout(timeout):
                    await self._changed.wait_for(
                        lambda: self._closed or self._idle or self._live < self.max_sessions)
            except TimeoutError:
                self.stats["refused_busy"] += 1
                return None
            if self._closed:
                return None
            if self._idle:
                child = self._idle.pop()
                self._busy.add(child)
                self._changed.notify_all()  # the filler starts the next spare
                return child
            self._starting += 1  # no spare ready: this session waits for a child of its own
        try:
            child = await self._spawn()
        except ChildStartError as e:
            log.warning("ggml child for a session failed to start: %s", e)
            child = None
        async with self._changed:
            self._starting -= 1
            if child is not None:
                self._busy.add(child)
            self._changed.notify_all()
        return child

    def release(self, child: GgmlChild) -> None:
        """The session is over: kill its child (the memory goes with it) and make room."""
        child.released = True
        self._busy.discard(child)
        if not all(t.done() for t in child.tasks):
            self._ending.add(child)
        _kill(child)
        self._notify()

    async def close(self) -> None:
        self._closed = True
        if self._filler is not None:
            self._filler.cancel()
            await asyncio.wait([self._filler])  # a child it was starting is reaped on the way out
        children = [*self._idle, *self._busy]
        self._idle.clear()
        self._busy.clear()
        for child in children:
            child.released = True
            _kill(child)
        # a session that ended just before holds a child still dying: its pipes and process
        # transport must be gone before the loop closes, like everyone else's
        children += self._ending
        self._ending.clear()
        for child in children:
            await _reap(child.proc, *child.tasks)
        self._notify()

    # ------------------------------------------------------------------ internals
    def _notify(self) -> None:
        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        asyncio.get_running_loop().create_task(notify())

    async def _fill(self) -> None:
        delay = 0.0
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self._closed or (
                    len(self._idle) + self._starting < self.spares and self._live < self.max_sessions))
                if self._closed:
                    return
                self._starting += 1
            try:
                if delay:
                    await asyncio.sleep(delay)  # children keep failing to start: do not spin
                child = await self._spawn()
            except ChildStartError as e:
                child = None
                delay = min(BACKOFF_MAX, max(BACKOFF_FIRST, delay * 2))
                log.warning("ggml child failed to start (%s); next try in %.1fs", e, delay)
            else:
                delay = 0.0
            finally:
                async with self._changed:
                    self._starting -= 1
                    self._changed.notify_all()
            if child is not None:
                async with self._changed:
                    if self._closed:
                        child.released = True
                        _kill(child)
                        return
                    self._idle.append(child)
                    self._changed.notify_all()

    async def _spawn(self) -> GgmlChild:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        path = os.pathsep.join(p for p in (ENGINE_DIR, os.environ.get("PYTHONPATH")) if p)
        proc = await asyncio.create_subprocess_exec(
            *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=ENGINE_DIR,
            # no gdb backtrace on a GGML_ASSERT: it takes seconds and floods our log
            env=dict(os.environ, PYTHONPATH=path, GGML_NO_BACKTRACE="1"),
            start_new_session=True)  # a signal to our process group is ours to handle, not the children's
        stderr = asyncio.create_task(_pump_stderr(proc), name=f"ggml-child-{proc.pid}-stderr")
        sock = None
        try:
            async with asyncio.timeout(START_TIMEOUT):
                port = int(_expect(await proc.stdout.readline(), "READY"))
                sock, reply = await asyncio.to_thread(open_session, "127.0.0.1", port, START_TIMEOUT)
                proc.stdin.write(b"seal\n")
                await proc.stdin.drain()
                accepted = int(_expect(await proc.stdout.readline(), "SEALED"))
            if accepted != 1:  # someone reached the port before us: never use this child
                self.stats["intruders"] += 1
                log.warning("ggml child %d: %d connections reached its private port, not only ours; discarded",
                            proc.pid, accepted)
                raise ChildStartError("its private port was reached by another process")
        except BaseException as e:  # also a cancellation (close() during a start): never leave the child
            if sock is not None:
                sock.close()
            _terminate(proc)
            await asyncio.shield(_reap(proc, stderr))
            if not isinstance(e, (OSError, TimeoutError, ValueError, ChildStartError)):
                raise
            self.stats["failed_starts"] += 1
            how = "" if proc.returncode is None else f"; it ended: {_describe(proc.returncode)}"
            raise ChildStartError((str(e) or type(e).__name__) + how) from None
        self.stats["started"] += 1
        self.start_ms = [*self.start_ms[-99:], (loop.time() - t0) * 1e3]
        child = GgmlChild(proc, sock, reply, [stderr])
        child.tasks.append(asyncio.create_task(self._watch(child), name=f"ggml-child-{proc.pid}"))
        return child

    async def _watch(self, child: GgmlChild) -> None:
        code = await child.proc.wait()
        # A released child may have crashed before our SIGKILL reached it: the session's socket
        # can reach EOF (and release it) before the reaper reports the exit, so the exit code
        # says which of the two ended it, not the order we heard of them.
        if code != 0 and not (child.released and code == -signal.SIGKILL):
            self.stats["crashed"] += 1
            log.warning("ggml child %d died: %s", child.pid, _describe(code))
        if child in self._idle:  # a spare died unused
            async with self._changed:
                self._idle.remove(child)
                child.sock.close()
                self._changed.notify_all()
        await asyncio.wait([t for t in child.tasks if t is not asyncio.current_task()])  # its stderr's EOF
        self._ending.discard(child)


async def _pump_stderr(proc: asyncio.subprocess.Process) -> None:
    while line := await proc.stderr.readline():
        line = line.rstrip()
        if line and not line.startswith(_EXPECTED_STDERR):
            log.info("ggml child %d: %r", proc.pid, line.decode("utf-8", "replace"))  # repr: no forged lines


async def _reap(proc: asyncio.subprocess.Process, *tasks: asyncio.Task) -> None:
    """Wait (bounded) for a killed child and its pumps, so no transport outlives the pool."""
    await asyncio.wait([asyncio.ensure_future(proc.wait()), *tasks], timeout=5.0)


def _kill(child: GgmlChild) -> None:
    try:
        child.sock.close()
    finally:
        _terminate(child.proc)


def _expect(line: bytes, word: str) -> str:
    parts = line.split()
    if len(parts) != 2 or parts[0] != word.encode():
        raise ChildStartError(f"expected {word}, the child said {line[:80]!r}")
    return parts[1].decode()


def _terminate(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def _describe(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"
