"""Erasing a slot that is working: deferred until it is free, as llama-server defers the task.

llama-server answers ``POST /slots/{id}?action=erase`` for a busy slot when the slot's task
ends; a coordinator that tolerates only 404/501 there logged an exception on every 409 we sent.
So an erase of a slot that generates or transfers state waits here, and is done by the actor
between two steps, as soon as the slot's job or transfer ends — before the jobs queued for the
slot, which wait meanwhile (a job naming no slot goes elsewhere). The reply is sent when the
erase is done.

Bounded both ways: at most ``limit`` erases wait per slot (``--slot-queue``; more → EngineBusy
at once), and each waits at most ``timeout`` seconds (then EngineBusy: the slot is still busy,
nothing was erased). The timer is ``EngineConfig.call_later`` so tests fire it when they say.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from .jobs import EngineBusy
from .slots import Slot

ERASE_TIMEOUT = 300.0  # s: as long as a reload may drain; a slot busy longer is stuck, not busy


class DeferredErases:
    def __init__(self, slots: list[Slot], limit: int, timeout: float,
                 call_later: Callable[[float, Callable[[], None]], Any] | None, wake: Callable[[], None]):
        self.slots, self.limit, self.timeout = slots, limit, timeout
        self._call_later, self._wake = call_later, wake

    def add(self, slot: Slot) -> asyncio.Future:
        """A future resolved with the tokens erased once the actor erased ``slot``."""
        waiting = [f for f in slot.erase_waiters if not f.done()]
        if len(waiting) >= max(1, self.limit):
            raise EngineBusy(f"slot {slot.id} is busy and {len(waiting)} erase(s) already wait for it")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        slot.erase_waiters = [*waiting, fut]
        timer = (self._call_later or loop.call_later)(self.timeout, lambda: self._expire(slot, fut))
        fut.add_done_callback(lambda _: timer.cancel())
        return fut

    def _expire(self, slot: Slot, fut: asyncio.Future) -> None:
        if not fut.done():
            fut.set_exception(EngineBusy(f"slot {slot.id} stayed busy for {self.timeout:g} s; it was not erased"))
        self._wake()  # the actor drops the waiter and admits the jobs it held back

    def due(self) -> list[Slot]:
        """Slots whose erase can run now (not busy, someone still waits); drops waiters that
        timed out or left. Called by the actor between steps."""
        out = []
        for slot in self.slots:
            if slot.erase_waiters:
                slot.erase_waiters = [f for f in slot.erase_waiters if not f.done()]
                if slot.erase_waiters and not slot.busy:
                    out.append(slot)
        return out

    @staticmethod
    def answer(slot: Slot, n_erased: int, error: BaseException | None = None) -> None:
        for f in slot.erase_waiters:
            if not f.done():
                if error is None:
                    f.set_result(n_erased)
                else:
                    f.set_exception(error)
        slot.erase_waiters = []

    def held(self) -> bool:
        return any(s.erase_waiters for s in self.slots)
