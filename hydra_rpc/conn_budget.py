"""One budget of open connections for the engine port and the HTTP side together, kept below
what the open-files limit allows, and the accept loop that honours it.

Every connection costs a file descriptor. When the process runs out (EMFILE), it can no longer
accept, open a model file or reply: clients are dropped without a word. So:

* at start the soft ``RLIMIT_NOFILE`` is raised to the hard limit (:func:`raise_nofile_limit`);
* the *ceiling* is what the limit leaves after the descriptors the server itself needs; at the
  ceiling the listening sockets stop accepting — new clients wait in the kernel's backlog, and
  are accepted as soon as a connection closes (never dropped in silence);
* ``--max-connections`` is kept a little below the ceiling: the connections between the two are
  accepted only to be told no — a Hydra client gets ``BUSY`` and a close once its first bytes
  say it speaks Hydra, an HTTP client a ``503``.

Connections that have not sent anything yet count like any other.
"""
from __future__ import annotations

import asyncio
import enum
import errno
import logging
import os
import resource
import socket
import sys
from typing import Any, Callable

log = logging.getLogger("hydra_rpc.connections")

RESERVED_FDS = 64  # beyond those open at start: model files of a reload, log files, ggml children…
ACCEPT_RETRY_DELAY = 1.0  # after EMFILE despite the budget, as asyncio's own accept loop waits
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def raise_nofile_limit() -> int:
    """Raise the soft open-files limit to the hard one; returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20) if soft != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:
        log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, e)
        return soft
    return hard


def open_fds() -> int:
    """Descriptors this process has open now (Linux; a guess elsewhere)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 32


class ConnectionBudget:
    """Open connections of both ports: ``over_limit`` above ``max_connections``; accepting
    pauses at ``ceiling``."""

    def __init__(self, max_connections: int, ceiling: int):
        self.max_connections = max_connections
        self.ceiling = ceiling
        self.open = 0
        self._paused: list[Callable[[], None]] = []  # acceptors waiting for room

    @classmethod
    def for_fd_limit(cls, requested: int, nofile: int, in_use: int) -> "ConnectionBudget":
        """``requested`` (--max-connections) lowered as far as the open-files limit needs:
        the ceiling leaves ``in_use`` + RESERVED_FDS descriptors to the server, and the limit
        leaves room under the ceiling to answer the ones over it."""
        ceiling = max(2, nofile - in_use - RESERVED_FDS)
        headroom = max(1, min(64, ceiling // 16))
        return cls(max(1, min(requested, ceiling - headroom)), ceiling)

    @property
    def over_limit(self) -> bool:
        return self.open > self.max_connections

    @property
    def has_room(self) -> bool:
        return self.open < self.ceiling

    def opened(self) -> None:
        self.open += 1

    def closed(self) -> None:
        self.open -= 1
        if self._paused and self.has_room:
            waiting, self._paused = self._paused, []
            for resume in waiting:
                resume()

    def wait_for_room(self, resume: Callable[[], None]) -> None:
        self._paused.append(resume)


class AcceptState(enum.Enum):
    STARTING = "starting"    # uvloop: a native server on a new duplicate of the socket is on its way
    ACCEPTING = "accepting"
    PAUSED = "paused"        # at the ceiling, or out of descriptors: clients wait in the backlog
    CLOSED = "closed"


_NEXT_STATES = {
    AcceptState.STARTING: {AcceptState.ACCEPTING, AcceptState.PAUSED, AcceptState.CLOSED},
    AcceptState.ACCEPTING: {AcceptState.PAUSED, AcceptState.CLOSED},
    AcceptState.PAUSED: {AcceptState.STARTING, AcceptState.ACCEPTING, AcceptState.CLOSED},
    AcceptState.CLOSED: set(),
}


LIBUV_ONE_ACCEPT_PER_TURN = (1 << 16) | (45 << 8)  # libuv 1.45: "unix: don't accept() connections in a loop"


def _native_accepts(loop: asyncio.AbstractEventLoop) -> bool:
    """uvloop's own accepts are used when its libuv takes one connection per loop turn: a
    flood of connects cannot hold the loop, and a pause decided in one turn holds before the
    next accept. asyncio's accept loop takes up to the backlog at once, past the ceiling."""
    if not type(loop).__module__.startswith("uvloop"):
        return False
    libuv_version = getattr(sys.modules.get("uvloop.loop"), "libuv_get_version", lambda: 0)()
    return libuv_version >= LIBUV_ONE_ACCEPT_PER_TURN


class Acceptor:
    """A listening socket whose accepts are counted against a :class:`ConnectionBudget`.

    ``factory`` makes the protocol of an accepted connection; whoever owns that protocol calls
    ``budget.closed()`` exactly once when the connection is gone. Looks enough like an
    ``asyncio.Server`` (``sockets``, ``close``, ``wait_closed``) for both ports' servers.

    On uvloop the accepts are libuv's, in C (a Python accept and ``connect_accepted_socket``
    cost ~35 µs more per connection: docs/performance.md, "The HTTP side alone"): a native server
    listens on a duplicate of the socket. At the ceiling that server is closed — the socket,
    and its backlog, stay open through the original — and a new one starts when a connection
    closes. On another loop this class accepts itself, in bursts of 64.
    """

    def __init__(self, sock: socket.socket, factory: Callable[[], asyncio.BaseProtocol], budget: ConnectionBudget,
                 backlog: int = 1024):
        self.sock = sock
        self.factory = factory
        self.budget = budget
        self.backlog = backlog
        self.state = AcceptState.PAUSED
        self._loop = asyncio.get_running_loop()
        self._native = _native_accepts(self._loop)
        self._server: asyncio.AbstractServer | None = None  # the native server, while accepting
        self._retry: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    def listen(cls, host: str, port: int, factory: Callable[[], asyncio.BaseProtocol],
               budget: ConnectionBudget, backlog: int = 1024) -> "Acceptor":
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family, backlog=backlog)
        sock.setblocking(False)
        acceptor = cls(sock, factory, budget, backlog)
        acceptor._resume()
        return acceptor

    @property
    def sockets(self) -> list[socket.socket]:
        return [] if self.state is AcceptState.CLOSED else [self.sock]

    def _move(self, to: AcceptState) -> None:
        if to not in _NEXT_STATES[self.state]:
            raise RuntimeError(f"acceptor: no transition {self.state.value} -> {to.value}")
        self.state = to

    # ---------------------------------------------------------------- accepting and pausing
    def _resume(self) -> None:
        self._retry = None
        if self.state is not AcceptState.PAUSED:
            return
        if self._native:
            self._move(AcceptState.STARTING)
            self._track(self._start_native())
        else:
            self._move(AcceptState.ACCEPTING)
            self._loop.add_reader(self.sock.fileno(), self._accept_ready)

    async def _start_native(self) -> None:
        if self.state is AcceptState.CLOSED:  # closed before this task's first step
            return
        try:
            server = await self._loop.create_server(self._accepted, sock=self.sock.dup(), backlog=self.backlog)
        except OSError as e:  # out of descriptors for the duplicate, say: clients wait in the backlog
            if self.state is AcceptState.STARTING:
                log.warning("cannot accept connections: %s; retrying in %.0f s", e.strerror, ACCEPT_RETRY_DELAY)
                self._move(AcceptState.PAUSED)
                self._retry = self._loop.call_later(ACCEPT_RETRY_DELAY, self._resume)
            return
        if self.state is AcceptState.CLOSED:
            server.close()
            return
        self._server = server
        self._move(AcceptState.ACCEPTING)

    def _pause_at_ceiling(self) -> None:
        # a connection may have closed since the accept that reached the ceiling: then no
        # close is left to resume a pause
        if self.state is not AcceptState.ACCEPTING or self.budget.has_room:
            return
        self._pause()
        self.budget.wait_for_room(self._resume)
        log.warning("%d connections open (engine port and HTTP): accepting resumes when one closes",
                    self.budget.open)

    def _pause(self) -> None:
        self._move(AcceptState.PAUSED)
        self._stop_accepting()

    def _stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()  # the duplicate's descriptor; the backlog stays on self.sock
            self._server = None
        elif not self._native:
            self._loop.remove_reader(self.sock.fileno())

    def _accepted(self) -> asyncio.BaseProtocol:
        """The native server's protocol factory: the connection is counted; at the ceiling
        accepting pauses at the end of this loop turn — closing the server here would close
        the descriptor libuv is about to hand over."""
        self.budget.opened()
        if not self.budget.has_room:
            self._loop.call_soon(self._pause_at_ceiling)
        try:
            return self.factory()
        except Exception:
            log.exception("dropped an accepted connection: its protocol could not be made")
            self.budget.closed()
            return _Dropped()

    def _accept_ready(self) -> None:
        for _ in range(64):  # a burst at a time, then the loop serves the others
            if not self.budget.has_room:
                self._pause_at_ceiling()
                return
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno not in OUT_OF_FDS:
                    raise
                log.warning("cannot accept a connection: %s; retrying in %.0f s", e.strerror, ACCEPT_RETRY_DELAY)
                self._pause()
                self._retry = self._loop.call_later(ACCEPT_RETRY_DELAY, self._resume)
                return
            conn.setblocking(False)
            self.budget.opened()
            self._track(self._connect(conn))

    def _track(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self.factory, conn)
        except BaseException as e:
            self.budget.closed()
            conn.close()
            if not isinstance(e, OSError):
                raise
            log.warning("dropped an accepted connection: %s", e)

    def close(self) -> None:
        if self.state is AcceptState.CLOSED:
            return
        if self.state is AcceptState.ACCEPTING:
            self._stop_accepting()
        if self._retry is not None:
            self._retry.cancel()
        self._move(AcceptState.CLOSED)
        self.sock.close()

    async def wait_closed(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks))


class _Dropped(asyncio.Protocol):
    """The protocol of a connection whose own could not be made: closed at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.abort()
