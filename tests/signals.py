"""Waiting for events instead of polling: a ``Signal`` is notified whenever something changes
(from any thread) and wakes the asyncio tasks waiting for a condition to re-check it, with a
deadline. The scripted backend's gates, builds and closes notify one (``tests.scripted_backend``),
and so do the engine actor's events under test (``tests.engine_env``)."""
from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Callable


DEADLINE = 30.0  # s: a safety net turning a hang into a failure, never a timing assumption


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # not on an event loop's thread
        return None


class Signal:
    """Something changed: wakes every task waiting in ``wait_for`` (which then re-checks its
    condition). ``notify`` may be called from any thread; ``forward`` signals are notified too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.forward: list[Signal] = []

    def notify(self) -> None:
        with self._lock:
            events = list(self._events)
        here = _running_loop()
        for loop, event in events:
            if loop is here:
                event.set()
            else:
                with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
                    loop.call_soon_threadsafe(event.set)
        for signal in self.forward:
            signal.notify()

    async def wait_for(self, predicate: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
        """Return once ``predicate()`` holds, checked now and after every notification;
        AssertionError after ``timeout`` seconds (a broken engine fails the test, never hangs it)."""
        key = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._events.append(key)
        try:
            async with asyncio.timeout(timeout):
                while not predicate():
                    await key[1].wait()
                    key[1].clear()  # cleared before the next check: a change after it sets it again
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}") from None
        finally:
            with self._lock:
                self._events.remove(key)
