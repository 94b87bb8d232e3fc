"""Progress-based read deadlines: idle between requests, stall between bytes, a minimum rate.

A *total* deadline on a transfer cuts a client on a slow but steady link (8 MiB at 1 MiB/s),
while a per-read stall deadline never cuts a dribbler that sends one byte a second. So, like
Apache's ``mod_reqtimeout`` ``MinRate``, a frame in progress (header, key, trace or payload)
must

* never go ``stall`` seconds without a byte, and
* average at least ``min_rate`` bytes/s over every ``window`` seconds spent waiting for it;

and between requests (nothing of the next one received yet) only ``idle`` applies.

Only time spent *waiting on the client* counts: while a handler works, or while the server
stopped reading (backpressure), the clock stands still — a client is never blamed for the
server's own delays. The class is pure (every method takes ``now``): the connection arms one
timer at :meth:`ReadClock.next_check` and asks :meth:`ReadClock.expired` when it fires.
"""
from __future__ import annotations

import asyncio
from typing import Callable

IDLE, STALLED, TOO_SLOW = "idle", "stalled", "too slow"


class ReadClock:
    def __init__(self, idle: float, stall: float, min_rate: float = 0.0, window: float = 0.0):
        self.idle_timeout, self.stall, self.min_rate, self.window = idle, stall, min_rate, window
        self.waiting = False
        self.idle = False  # waiting with nothing of a frame received
        self._wait_since = 0.0  # start of the current wait
        self._last_rx = 0.0
        self._seg_since = 0.0  # start of the current wait's part of the rate window
        self._win_waited = 0.0  # waiting time in the window before _seg_since
        self._win_bytes = 0

    def wait(self, now: float, idle: bool) -> None:
        """The server starts waiting for the client (``idle``: for a new request)."""
        self.waiting, self.idle = True, idle
        self._wait_since = self._seg_since = now

    def stop(self, now: float) -> None:
        """The server stops waiting (it has what it asked for, or it is closing)."""
        if self.waiting and not self.idle:
            self._win_waited += now - self._seg_since
        self.waiting = False

    def new_frame(self) -> None:
        """A request is done: the next frame starts a fresh rate window."""
        self._win_waited, self._win_bytes = 0.0, 0

    def received(self, nbytes: int, now: float) -> None:
        self._last_rx = now
        self._win_bytes += nbytes
        if self.waiting and self.idle:  # the first bytes of a frame: its clock starts now
            self.idle = False
            self._wait_since = self._seg_since = now
            self._win_waited, self._win_bytes = 0.0, nbytes

    def expired(self, now: float) -> str | None:
        """Why the client is given up on at ``now`` (``IDLE``, ``STALLED``, ``TOO_SLOW``), or None.
        A window that met the rate is rolled over."""
        if not self.waiting:
            return None
        if self.idle:
            return IDLE if now - self._wait_since >= self.idle_timeout else None
        if now - max(self._last_rx, self._wait_since) >= self.stall:
            return STALLED
        if self.min_rate > 0:
            waited = self._win_waited + now - self._seg_since
            if waited >= self.window:
                if self._win_bytes < self.min_rate * waited:
                    return TOO_SLOW
                self._seg_since, self._win_waited, self._win_bytes = now, 0.0, 0
        return None

    def next_check(self) -> float | None:
        """The earliest time :meth:`expired` can give a reason (None while not waiting)."""
        if not self.waiting:
            return None
        if self.idle:
            return self._wait_since + self.idle_timeout
        at = max(self._last_rx, self._wait_since) + self.stall
        if self.min_rate > 0:
            at = min(at, self._seg_since + self.window - self._win_waited)
        return at

    def describe(self, reason: str) -> str:
        if reason == IDLE:
            return f"idle for {self.idle_timeout:g}s between requests"
        if reason == STALLED:
            return f"no byte of a started frame for {self.stall:g}s"
        return f"a frame arriving slower than {self.min_rate:g} bytes/s over {self.window:g}s"


class ClockTimer:
    """The one loop timer of a connection's :class:`ReadClock`: armed for the clock's next check,
    it calls ``on_expired(reason)`` when a deadline has passed (and re-arms when none has)."""

    def __init__(self, clock: ReadClock, on_expired: Callable[[str], None]):
        self.clock = clock
        self.on_expired: Callable[[str], None] | None = on_expired
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        if self.on_expired is None:
            return  # disarmed for good
        at = self.clock.next_check()
        if at is None or (self._handle is not None and self._handle.when() <= at):
            return  # an earlier timer re-arms when it fires
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._loop.call_at(at, self._fire, at)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def disarm(self) -> None:
        """For good: the connection is gone. The callback is a bound method of the connection,
        which holds this timer — kept, every finished connection would be a reference cycle only
        the cyclic GC frees (its full collections stopped the loop for 30–50 ms with 1,000
        connections open; docs/performance.md, 'Per request'). Later ``arm()`` calls do nothing."""
        self.cancel()
        self.on_expired = None

    def _fire(self, at: float) -> None:
        self._handle = None
        reason = self.clock.expired(max(at, self._loop.time()))
        if reason is None:
            self.arm()
        else:
            self.on_expired(reason)
