"""conn_budget.Acceptor, step by step on a real listening socket: accepting pauses at the
budget's ceiling with the next client left in the kernel's backlog (connected, not accepted,
not reset) and resumes when a connection closes — with libuv's own accepts on uvloop and with
the acceptor's own on asyncio's loop."""
from __future__ import annotations

import asyncio
import errno
import socket

import pytest
import uvloop

from hydra_rpc.conn_budget import Acceptor, AcceptState, ConnectionBudget
from tests.helpers import poll_until

pytestmark = pytest.mark.timeout(60)


class Counted(asyncio.Protocol):
    """A connection that gives its place in the budget back when it is gone."""

    def __init__(self, budget: ConnectionBudget, made: list["Counted"]):
        self.budget, self.made = budget, made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.made.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.budget.closed()


async def until(predicate, what: str) -> None:
    """Until ``predicate()`` holds (``what`` names it where the test waits)."""
    await poll_until(lambda: asyncio.sleep(0), lambda _: predicate(), 10)


async def pause_and_resume() -> None:
    budget = ConnectionBudget(max_connections=1, ceiling=2)
    made: list[Counted] = []
    acceptor = Acceptor.listen("127.0.0.1", 0, lambda: Counted(budget, made), budget)
    await until(lambda: acceptor.state is AcceptState.ACCEPTING, "accepting")
    port = acceptor.sockets[0].getsockname()[1]
    clients = []
    try:
        for _ in range(3):  # the third finds the ceiling: the kernel completes its handshake
            clients.append(socket.create_connection(("127.0.0.1", port)))
        await until(lambda: len(made) == 2 and acceptor.state is AcceptState.PAUSED, "the pause at the ceiling")
        for _ in range(20):  # loop turns in which nothing more is accepted
            await asyncio.sleep(0)
        assert len(made) == 2 and budget.open == 2
        made[0].transport.close()  # a place frees: the third is accepted from the backlog
        await until(lambda: len(made) == 3, "the waiting client accepted")
        assert budget.open == 2 and acceptor.state is AcceptState.PAUSED  # at the ceiling again
        clients[2].sendall(b"x")  # it was never reset
    finally:
        acceptor.close()
        for c in clients:
            c.close()
        for p in made:
            p.transport.close()
    assert acceptor.state is AcceptState.CLOSED and acceptor.sockets == []
    await acceptor.wait_closed()


@pytest.mark.parametrize("run", [uvloop.run, asyncio.run], ids=["uvloop", "asyncio"])
def test_accepting_pauses_at_the_ceiling_and_resumes_when_a_connection_closes(run):
    run(pause_and_resume())


def test_a_close_between_the_accept_at_the_ceiling_and_the_pause_keeps_accepting():
    """libuv's accept that reaches the ceiling pauses at the end of the loop turn; a connection
    that closes meanwhile leaves room — a pause then would wait for a close that may never come."""
    async def main() -> None:
        budget = ConnectionBudget(max_connections=1, ceiling=2)
        acceptor = Acceptor.listen("127.0.0.1", 0, asyncio.Protocol, budget)
        await until(lambda: acceptor.state is AcceptState.ACCEPTING, "accepting")
        budget.opened()
        acceptor._accepted()  # what the native server calls for the connection that fills it
        assert budget.open == 2 and not budget.has_room
        budget.closed()  # before the loop turn ends
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert acceptor.state is AcceptState.ACCEPTING
        acceptor._accepted()  # full again, and nothing closes: now it pauses
        await until(lambda: acceptor.state is AcceptState.PAUSED, "the pause")
        acceptor.close()
        await acceptor.wait_closed()

    uvloop.run(main())


def test_a_native_server_that_cannot_start_retries(monkeypatch):
    """No descriptor for the duplicate: the acceptor waits and tries again (its retry timer),
    instead of staying 'starting' with nothing accepting."""
    async def main() -> None:
        budget = ConnectionBudget(max_connections=4, ceiling=8)
        with monkeypatch.context() as m:
            m.setattr(socket.socket, "dup", lambda self: (_ for _ in ()).throw(OSError(errno.EMFILE, "Too many")))
            acceptor = Acceptor.listen("127.0.0.1", 0, asyncio.Protocol, budget)
            await until(lambda: acceptor.state is AcceptState.PAUSED, "the pause after the failed start")
        assert acceptor._retry is not None
        acceptor._retry.cancel()
        acceptor._resume()  # what the timer does a second later
        await until(lambda: acceptor.state is AcceptState.ACCEPTING, "accepting")
        acceptor.close()
        await acceptor.wait_closed()

    uvloop.run(main())


def test_the_acceptor_moves_only_along_its_transitions():
    async def main() -> None:
        budget = ConnectionBudget(max_connections=4, ceiling=8)
        acceptor = Acceptor.listen("127.0.0.1", 0, asyncio.Protocol, budget)
        acceptor.close()
        with pytest.raises(RuntimeError, match="no transition closed -> accepting"):
            acceptor._move(AcceptState.ACCEPTING)
        acceptor._resume()  # a resume after the close starts nothing
        assert acceptor.state is AcceptState.CLOSED
        await acceptor.wait_closed()

    uvloop.run(main())
