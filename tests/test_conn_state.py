"""The Hydra connection's state machines (hydra_rpc.hydra.conn_state) and its flow control
(hydra_rpc.hydra.flow_control): every move of the tables works, every other one raises, and
the connection walks the tables as a request is served, stopped and closed.

No wall clock: the connection runs over the in-memory transport, and waiting for a state is a
bounded number of event-loop turns (``until``)."""
from __future__ import annotations

import asyncio
import itertools

import pytest

from codec.enums import Op, Status
from codec.framing import encode_request
from codec.limits import Limits
from hydra_rpc.config import ServerConfig
from hydra_rpc.hydra.conn_state import (GRACEFUL_STOP, LEGAL_MOVES, REQUEST_ENDS, REQUEST_STARTS,
                                        SERVING_EVENTS, ConnState, IllegalTransition, Peer, Serving,
                                        serving_after)
from hydra_rpc.hydra.connection import HydraConnection
from hydra_rpc.hydra.flow_control import FlowControl
from hydra_rpc.hydra.wire import PeerGone
from tests.memory_transport import MemoryTransport

ALL_STATES = [*Serving, *Peer]
LEGAL = [(frm, to) for frm, targets in LEGAL_MOVES.items() for to in sorted(targets, key=lambda s: s.name)]
ILLEGAL = [(frm, to) for frm, to in itertools.product(ALL_STATES, ALL_STATES)
           if type(frm) is type(to) and to not in LEGAL_MOVES[frm]]


def path_to(target: Serving | Peer) -> list[Serving | Peer]:
    """Legal moves from a fresh ConnState to ``target`` (breadth first: the shortest)."""
    start = Serving.IDLE if isinstance(target, Serving) else Peer.CONNECTED
    paths = {start: []}
    frontier = [start]
    while frontier:
        nxt = []
        for state in frontier:
            for to in LEGAL_MOVES[state]:
                if to not in paths:
                    paths[to] = paths[state] + [to]
                    nxt.append(to)
        frontier = nxt
    return paths[target]


def state_at(target: Serving | Peer) -> ConnState:
    st = ConnState()
    for to in path_to(target):
        st.move(to)
    return st


def current(st: ConnState, like: Serving | Peer) -> Serving | Peer:
    return st.serving if isinstance(like, Serving) else st.peer


# ---------------------------------------------------------------- the tables
def test_the_table_covers_every_state_and_each_is_reachable():
    assert set(LEGAL_MOVES) == set(ALL_STATES)
    for state in ALL_STATES:
        path_to(state)  # KeyError if unreachable


@pytest.mark.parametrize(("frm", "to"), LEGAL, ids=lambda s: s.name)
def test_every_legal_move_is_taken(frm, to):
    st = state_at(frm)
    st.move(to)
    assert current(st, to) is to


@pytest.mark.parametrize(("frm", "to"), ILLEGAL, ids=lambda s: s.name)
def test_every_other_move_raises_and_changes_nothing(frm, to):
    st = state_at(frm)
    before = (st.serving, st.peer)
    with pytest.raises(IllegalTransition, match=f"from {frm.name} to {to.name}"):
        st.move(to)
    assert (st.serving, st.peer) == before


def test_the_two_machines_move_independently():
    st = ConnState()
    st.move(Serving.IN_REQUEST)
    st.move(Peer.HALF_CLOSED)
    assert (st.serving, st.peer) == (Serving.IN_REQUEST, Peer.HALF_CLOSED)
    assert st.in_request and not st.readable and st.writable and not st.finished
    st.move(Peer.GONE)
    st.move(Serving.IDLE)
    st.move(Serving.SERVED)
    assert st.finished and not st.writable


def test_every_serving_event_lands_on_a_legal_move():
    for event, moves in SERVING_EVENTS.items():
        for frm, to in moves.items():
            assert to in LEGAL_MOVES[frm], (event, frm, to)


@pytest.mark.parametrize("event", [REQUEST_STARTS, REQUEST_ENDS, GRACEFUL_STOP])
def test_a_serving_event_in_a_state_without_a_move_for_it_raises(event):
    for state in Serving:
        if state in SERVING_EVENTS[event]:
            assert serving_after(event, state) in LEGAL_MOVES[state]
        else:
            with pytest.raises(IllegalTransition, match=f"{state.name} has no move for '{event}'"):
                serving_after(event, state)


def test_stopping_and_in_request_read_the_serving_state():
    flags = {s: (state_at(s).in_request, state_at(s).stopping) for s in Serving}
    assert flags == {Serving.IDLE: (False, False), Serving.IN_REQUEST: (True, False),
                     Serving.LAST_REQUEST: (True, True), Serving.STOPPING: (False, True),
                     Serving.SERVED: (False, False)}


# ---------------------------------------------------------------- the connection walks the tables
class Held:
    """Handlers: INFO answers at once; PREFILL waits for ``release``."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = 0

    def table(self):
        return {int(Op.INFO): self.info, int(Op.PREFILL): self.hold}

    async def info(self, req, resp):
        await resp.send(Status.OK, {"engine": "fake"})

    async def hold(self, req, resp):
        self.entered += 1
        await self.release.wait()
        await resp.send(Status.OK, None)


async def until(cond, what: str) -> None:
    for _ in range(10_000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


def connection(handlers: Held) -> tuple[HydraConnection, MemoryTransport, asyncio.Future]:
    conn = HydraConnection(ServerConfig(limits=Limits()), handlers.table(), 1, "test", None)
    transport = MemoryTransport(conn)
    return conn, transport, asyncio.ensure_future(conn.serve())


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_request_then_a_close_walks_both_tables_and_lets_go():
    held = Held()
    conn, t, task = connection(held)
    assert (conn.state.serving, conn.state.peer) == (Serving.IDLE, Peer.CONNECTED)
    t.feed(encode_request(Op.PREFILL, b"0"))
    await until(lambda: held.entered == 1, "the request running")
    assert conn.state.serving is Serving.IN_REQUEST and conn.in_request
    held.release.set()
    await until(lambda: conn.requests == 1, "the request answered")
    assert conn.state.serving is Serving.IDLE and not conn.in_request
    t.feed_eof()
    await asyncio.wait_for(task, 10)
    assert conn.state.serving is Serving.SERVED and conn.peer_gone.is_set()
    await until(lambda: conn.state.peer is Peer.GONE, "the transport lost")
    assert conn.state.finished and conn.transport is None  # let go: no reference cycle left


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_graceful_stop_finishes_the_request_in_flight_then_ends():
    held = Held()
    conn, t, task = connection(held)
    t.feed(encode_request(Op.PREFILL, b"0") + encode_request(Op.INFO))
    await until(lambda: held.entered == 1, "the request running")
    conn.stopping = True
    assert conn.state.serving is Serving.LAST_REQUEST and conn.stopping and conn.in_request
    conn.stopping = True  # a second shutdown asks again: nothing changes
    assert conn.state.serving is Serving.LAST_REQUEST
    with pytest.raises(ValueError, match="cannot be taken back"):
        conn.stopping = False
    held.release.set()
    await asyncio.wait_for(task, 10)
    assert conn.state.serving is Serving.SERVED and conn.requests == 1  # the pipelined INFO is not served
    await until(lambda: t.closed, "the transport closed")


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_graceful_stop_while_idle_serves_at_most_the_request_already_coming():
    held = Held()
    conn, t, task = connection(held)
    await until(lambda: conn._waiter is not None, "waiting for a request")  # noqa: SLF001
    conn.stopping = True
    assert conn.state.serving is Serving.STOPPING and not conn.in_request
    t.feed(encode_request(Op.INFO) * 2)
    await asyncio.wait_for(task, 10)
    assert conn.requests == 1 and conn.state.serving is Serving.SERVED


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_an_illegal_move_on_the_connection_raises_and_changes_nothing():
    conn, t, task = connection(Held())
    with pytest.raises(IllegalTransition, match="from IDLE to LAST_REQUEST"):
        conn._transition(Serving.LAST_REQUEST)  # noqa: SLF001
    assert conn.state.serving is Serving.IDLE
    t.close()
    await asyncio.wait_for(task, 10)
    with pytest.raises(IllegalTransition, match="from GONE to HALF_CLOSED"):
        conn.eof_received()  # asyncio never reports an EOF after the connection is lost
    assert conn.state.finished


# ---------------------------------------------------------------- flow control
class CountingTransport:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")


def test_reading_reaches_the_transport_only_on_a_change():
    t = CountingTransport()
    flow = FlowControl(t)
    flow.resume_reading()
    flow.pause_reading()
    flow.pause_reading()
    assert flow.reading_paused
    flow.resume_reading()
    flow.resume_reading()
    assert t.calls == ["pause", "resume"] and not flow.reading_paused


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_drain_waits_while_writing_is_paused():
    flow = FlowControl(CountingTransport())
    await asyncio.wait_for(flow.drain(), 5)  # not paused: returns at once
    flow.pause_writing()
    waiters = [asyncio.ensure_future(flow.drain()) for _ in range(2)]
    await until(lambda: flow.drain_waiters == 2, "two writers waiting")
    assert not any(w.done() for w in waiters)
    flow.resume_writing()
    await asyncio.wait_for(asyncio.gather(*waiters), 5)
    assert flow.drain_waiters == 0 and not flow.writing_paused


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_lost_transport_fails_each_waiting_writer_with_its_own_error():
    flow = FlowControl(CountingTransport())
    flow.pause_writing()
    waiters = [asyncio.ensure_future(flow.drain()) for _ in range(2)]
    await until(lambda: flow.drain_waiters == 2, "two writers waiting")
    flow.fail_writers(lambda: PeerGone("gone"))
    errors = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 5)
    assert all(isinstance(e, PeerGone) for e in errors) and errors[0] is not errors[1]
    flow.detach()
    assert flow.transport is None
