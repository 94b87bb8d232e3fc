"""The Hydra connection's state: two small machines, each an enum and one table of legal moves.

Like h11's ``_state.py``, which keeps one machine per party, the connection keeps one for
each side, because they change independently — a client may half-close while a request is
being answered, or reset in the middle of one:

``Serving`` — what the serving task is doing::

    IDLE ──request starts──▶ IN_REQUEST ──request ends──▶ IDLE
    IDLE ──graceful stop──▶ STOPPING ──request starts──▶ LAST_REQUEST
    IN_REQUEST ──graceful stop──▶ LAST_REQUEST ──request ends──▶ STOPPING
    IDLE, STOPPING ──serve() returns──▶ SERVED

``Peer`` — what the client's end of the TCP connection still does::

    CONNECTED ──eof_received──▶ HALF_CLOSED ──connection_lost──▶ GONE
    CONNECTED ──connection_lost──▶ GONE

A graceful stop while idle does not interrupt the wait for the next request: a request that
then arrives is served, as the last one. ``serve()`` only returns between requests (the
request scope always ends first), so SERVED is reached from IDLE or STOPPING only.

The connection is let go (transport and deadline timer dropped) once both are done —
``SERVED`` and ``GONE`` — in whichever order they come.
"""
from __future__ import annotations

import enum


class IllegalTransition(RuntimeError):
    """A move the table does not allow: a bug in the connection, never the client's doing."""


class Serving(enum.Enum):
    IDLE = "idle"  # between requests: waiting for the next header
    IN_REQUEST = "in request"  # one request is being answered
    LAST_REQUEST = "last request"  # a graceful stop came during it: answer it, then close
    STOPPING = "stopping"  # a graceful stop, no request in flight: close at the loop's next check
    SERVED = "served"  # serve() (or refuse_connection) has returned


class Peer(enum.Enum):
    CONNECTED = "connected"
    HALF_CLOSED = "half-closed"  # its FIN arrived: nothing more to read, replies still go out
    GONE = "gone"  # the transport is lost: nothing can be written either


LEGAL_MOVES: dict[enum.Enum, frozenset[enum.Enum]] = {
    Serving.IDLE: frozenset({Serving.IN_REQUEST, Serving.STOPPING, Serving.SERVED}),
    Serving.IN_REQUEST: frozenset({Serving.IDLE, Serving.LAST_REQUEST}),
    Serving.STOPPING: frozenset({Serving.LAST_REQUEST, Serving.SERVED}),
    Serving.LAST_REQUEST: frozenset({Serving.STOPPING}),
    Serving.SERVED: frozenset(),
    Peer.CONNECTED: frozenset({Peer.HALF_CLOSED, Peer.GONE}),
    Peer.HALF_CLOSED: frozenset({Peer.GONE}),
    Peer.GONE: frozenset(),
}

# Events of the serving task, and where each takes it from each state it may come in (whether
# a graceful stop was asked picks the next state). ``serving_after`` raises on any other.
REQUEST_STARTS, REQUEST_ENDS, GRACEFUL_STOP = "request starts", "request ends", "graceful stop"
SERVING_EVENTS: dict[str, dict[Serving, Serving]] = {
    REQUEST_STARTS: {Serving.IDLE: Serving.IN_REQUEST, Serving.STOPPING: Serving.LAST_REQUEST},
    REQUEST_ENDS: {Serving.IN_REQUEST: Serving.IDLE, Serving.LAST_REQUEST: Serving.STOPPING},
    GRACEFUL_STOP: {Serving.IDLE: Serving.STOPPING, Serving.IN_REQUEST: Serving.LAST_REQUEST},
}


def serving_after(event: str, current: Serving) -> Serving:
    """The state ``event`` leads to from ``current``; the move is still checked on the way."""
    to = SERVING_EVENTS[event].get(current)
    if to is None:
        raise IllegalTransition(f"connection serving state {current.name} has no move for '{event}'")
    return to


class ConnState:
    """Both machines' current states; ``move`` is the only way to change either."""

    __slots__ = ("serving", "peer")

    def __init__(self) -> None:
        self.serving = Serving.IDLE
        self.peer = Peer.CONNECTED

    def move(self, to: Serving | Peer) -> None:
        current = self.serving if isinstance(to, Serving) else self.peer
        if to not in LEGAL_MOVES[current]:
            raise IllegalTransition(f"connection {type(to).__name__.lower()} state cannot go from "
                                    f"{current.name} to {to.name}")
        if isinstance(to, Serving):
            self.serving = to
        else:
            self.peer = to

    @property
    def in_request(self) -> bool:
        return self.serving is Serving.IN_REQUEST or self.serving is Serving.LAST_REQUEST

    @property
    def stopping(self) -> bool:
        return self.serving is Serving.STOPPING or self.serving is Serving.LAST_REQUEST

    @property
    def readable(self) -> bool:
        """More bytes may still arrive from the client."""
        return self.peer is Peer.CONNECTED

    @property
    def writable(self) -> bool:
        return self.peer is not Peer.GONE

    @property
    def finished(self) -> bool:
        """Served and the transport gone: nothing of this connection is in use any more."""
        return self.serving is Serving.SERVED and self.peer is Peer.GONE

    def __repr__(self) -> str:
        return f"<ConnState serving={self.serving.name} peer={self.peer.name}>"
