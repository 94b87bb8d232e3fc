"""Backpressure both ways for one Hydra connection (after uvicorn's ``FlowControl``).

Reading: the connection pauses the transport while a request's unread bytes pile up and
resumes it when the serving task waits for more; each call reaches the transport only when
it changes something, so callers need not track whether reading is paused.

Writing: the transport calls ``pause_writing``/``resume_writing`` around its high-water mark;
``drain`` waits while it is paused. Waiters are futures rather than an ``asyncio.Event`` so
that a lost connection can fail them with its own exception (``fail_writers``) instead of
waking them into a write that cannot happen.
"""
from __future__ import annotations

import asyncio
from typing import Callable


class FlowControl:
    __slots__ = ("transport", "reading_paused", "writing_paused", "_drain_waiters")

    def __init__(self, transport: asyncio.Transport | None = None):
        # None once detached: the transport points back at the connection, and the connection
        # must be freed by reference counting once it is done (see HydraConnection._let_go)
        self.transport = transport
        self.reading_paused = False
        self.writing_paused = False
        self._drain_waiters: list[asyncio.Future] = []

    def detach(self) -> None:
        self.transport = None

    # ---------------------------------------------------------------- reading
    def pause_reading(self) -> None:
        if not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()

    # ---------------------------------------------------------------- writing
    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_result(None)
        self._drain_waiters.clear()

    def fail_writers(self, make_error: Callable[[], BaseException]) -> None:
        """The transport is gone: every writer waiting in ``drain`` raises ``make_error()`` (one
        exception each: a shared one would collect every waiter's traceback)."""
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_exception(make_error())
        self._drain_waiters.clear()

    async def drain(self) -> None:
        if self.writing_paused:
            fut = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(fut)
            await fut

    @property
    def drain_waiters(self) -> int:
        return len(self._drain_waiters)
