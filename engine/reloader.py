"""Reloads (T2/T3/T4 CONFIGURE, model-alias swaps): every transition in one place.

A reload never stops the engine from answering. In ``shadow`` mode the new model is built
on the loader thread while the live one serves; once built, the engine stops admitting new
generation work, lets in-flight work finish, swaps, and frees the old model off-loop. In
``inplace`` mode (memory for one model only) the engine drains first, frees the old model,
then builds. The drain timeout is measured from staging, like the C++ engine's; when it
passes before the swap, the reload is dropped and the old config keeps serving. A newer
config replaces a pending one (as in the C++); asking again for the pending target joins it.

The ``Reloader`` runs on the actor task only: builds finish on the loader thread and come
back as ``BuildDone`` messages, timers as ``DrainTimeout`` messages. Every change of phase
goes through ``Reloader._advance``, checked against the table in :mod:`engine.reload_state`
(also ``docs/architecture.md``, reload state machine).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

from .backend import BackendFactory, ModelBackend
from .jobs import ReloadFailed
from .model_params import ModelParams
from .reload_state import ReloadEvent, next_phase
from .status import ReloadState, ReloadStatus

log = logging.getLogger("engine.reload")

LOADING, DRAINING = ReloadState.LOADING, ReloadState.DRAINING


class Generations:
    """config_generation: unique and monotonic per applied config.

    A pending reload reserves the next number (the CONFIGURE reply promises it). If any other
    config is applied before the swap (a T1 CONFIGURE), the reserved number is older than
    what is live by then, and the swap takes a fresh one: never reuse, never go back.
    """

    def __init__(self) -> None:
        self.live = 1
        self._last = 1

    def apply(self) -> int:
        """A config applied now (T1)."""
        self._last += 1
        self.live = self._last
        return self.live

    def reserve(self) -> int:
        self._last += 1
        return self._last

    def go_live(self, reserved: int) -> int:
        """A reload swaps in: its reserved number if nothing was applied or reserved since."""
        if reserved == self._last:
            self.live = reserved
            return reserved
        return self.apply()


@dataclass(eq=False)
class ReloadTicket:
    """One reload attempt; ``EngineApi.wait_reload(ticket)`` waits for it to go live or fail."""

    params: ModelParams
    generation: int  # reserved; the live generation once swapped
    outcome: asyncio.Future  # result: None when live, else why not (no exception: nobody may wait)
    shadow: ModelBackend | None = None
    load_ms: float = 0.0
    progress: float = 0.0  # written by the loader thread while it builds, read by INFO
    timer: Any = field(default=None, repr=False)

    def set_progress(self, share: float) -> None:
        self.progress = share


@dataclass(frozen=True)
class BuildDone:
    ticket: ReloadTicket
    result: concurrent.futures.Future | asyncio.Future
    load_ms: float


@dataclass(frozen=True)
class DrainTimeout:
    ticket: ReloadTicket


class ReloadHost(Protocol):
    """What the reloader needs from the engine actor."""

    model: ModelBackend | None
    params: ModelParams
    generations: Generations
    loader: concurrent.futures.Executor | None

    def post(self, message: object) -> None: ...
    def quiescent(self) -> bool: ...
    def busy_slots(self) -> list[int]: ...
    def install(self, model: ModelBackend | None, params: ModelParams) -> ModelBackend | None: ...
    def admit_queued(self) -> None: ...
    def lost_model(self, error: str) -> None: ...


class Reloader:
    def __init__(self, host: ReloadHost, factory: BackendFactory, *, mode: str, drain_timeout: float,
                 call_later: Callable[[float, Callable[[], None]], Any] | None = None):
        self.host = host
        self.factory = factory
        self.mode = mode  # shadow | inplace
        self.drain_timeout = drain_timeout
        self._call_later = call_later
        self.status = ReloadStatus()
        self.current: ReloadTicket | None = None

    @property
    def pending(self) -> bool:
        return self.current is not None

    def live_status(self) -> ReloadStatus:
        """``status`` with the progress the loader thread has reported so far."""
        t = self.current
        if t is not None and self.status.state is LOADING and t.progress != self.status.progress:
            return replace(self.status, progress=t.progress)
        return self.status

    @property
    def blocks_admission(self) -> bool:
        """Draining: in-flight work finishes, new generation work waits for the swap."""
        return self.status.state is DRAINING

    # ------------------------------------------------------------------ requests
    def request(self, params: ModelParams, tier: str, keys: list[str]) -> ReloadTicket:
        """Reload to ``params``; a pending reload to the same params is joined, another replaced."""
        if self.current is not None:
            if self.current.params == params:
                return self.current
            self.cancel(f"superseded by a newer config ({tier}: {', '.join(keys)})")
        loop = asyncio.get_running_loop()
        ticket = ReloadTicket(params, self.host.generations.reserve(), loop.create_future())
        self.current = ticket
        call_later = self._call_later or loop.call_later
        ticket.timer = call_later(self.drain_timeout, lambda: self.host.post(DrainTimeout(ticket)))
        inplace_drain = self.mode == "inplace" and self.host.model is not None
        self._advance(ReloadEvent.STAGE_DRAIN if inplace_drain else ReloadEvent.STAGE_BUILD,
                      ReloadStatus(generation=ticket.generation, target=params.model_path, tier=tier,
                                   started_at=time.time(), keys=tuple(dict.fromkeys(keys)),
                                   model_bytes=_size(params.model_path)))
        if not inplace_drain:  # shadow; or in-place with no model left to free
            self._build(ticket)
        return ticket

    def cancel(self, reason: str) -> None:
        """Drop the pending reload (a newer config replaced it, or the engine stops)."""
        if self.current is not None:
            log.info("reload to generation %d dropped: %s", self.current.generation, reason)
            self._end(self.current, ReloadEvent.DROP, reason)
            self.host.admit_queued()  # what waited for a drain that no longer happens

    # ------------------------------------------------------------------ messages
    async def on_build_done(self, msg: BuildDone) -> None:
        ticket = msg.ticket
        try:
            model, error = msg.result.result(), None
        except Exception as e:
            model, error = None, e
        if ticket is not self.current:  # replaced or dropped while it was building
            if model is not None:
                await asyncio.get_running_loop().run_in_executor(self.host.loader, model.close)
            return
        ticket.load_ms = msg.load_ms
        self.status = replace(self.status, load_ms=msg.load_ms, progress=1.0 if error is None else ticket.progress)
        if error is not None:
            log.warning("reload failed, still serving generation %d: %s", self.host.generations.live, error)
            self._end(ticket, ReloadEvent.BUILD_FAILED, str(error))
            if self.host.model is None:  # in-place freed the old model: bring it back
                await self._restore()
            return
        if self.host.model is None:  # in-place: the old model is gone already
            self._swap(ticket, model)
            return
        ticket.shadow = model
        self._advance(ReloadEvent.SHADOW_BUILT)

    async def on_drain_timeout(self, msg: DrainTimeout) -> None:
        if msg.ticket is not self.current:
            return
        if self.status.state is LOADING and self.host.model is None:
            return  # in-place past the point of no return: the old model is freed, this build must finish
        reason = (f"drain timeout of {self.drain_timeout:g}s passed with slots {self.host.busy_slots()} still "
                  f"busy; pending config dropped")
        log.warning(reason)
        self._end(msg.ticket, ReloadEvent.DROP, reason)
        self.host.admit_queued()

    async def maybe_swap(self) -> None:
        """Called by the actor between steps: swap (or, in-place, free and build) once drained."""
        ticket = self.current
        if ticket is None or self.status.state is not DRAINING or not self.host.quiescent():
            return
        if ticket.shadow is None:  # in-place: free first, then build
            old = self.host.install(None, self.host.params)
            self._advance(ReloadEvent.FREE_OLD)
            if old is not None:
                await asyncio.get_running_loop().run_in_executor(self.host.loader, old.close)
            self._build(ticket)
            return
        model, ticket.shadow = ticket.shadow, None
        self._swap(ticket, model)

    # ------------------------------------------------------------------ transitions
    def _advance(self, event: ReloadEvent, status: ReloadStatus | None = None, **changes: Any) -> None:
        """The one place the phase changes: ``event`` must be legal in the current phase (else
        IllegalReloadTransition, and the status stays). ``status``: a fresh one, for a new reload."""
        phase = next_phase(self.status.state, event)
        self.status = replace(status or self.status, state=phase, **changes)

    def _build(self, ticket: ReloadTicket) -> None:
        t0 = time.perf_counter()
        ticket.progress = 0.0
        build = functools.partial(self.factory.build, ticket.params, progress=ticket.set_progress)
        fut = asyncio.get_running_loop().run_in_executor(self.host.loader, build)
        fut.add_done_callback(lambda f: self.host.post(BuildDone(ticket, f, (time.perf_counter() - t0) * 1000)))

    def _swap(self, ticket: ReloadTicket, model: ModelBackend) -> None:
        t0 = time.perf_counter()
        ticket.generation = self.host.generations.go_live(ticket.generation)
        old = self.host.install(model, ticket.params)
        self.status = replace(self.status, generation=ticket.generation,
                              swap_ms=(time.perf_counter() - t0) * 1000)
        log.info("swapped to config generation %d (%s) after %.0f ms load", ticket.generation,
                 ticket.params.model_path, ticket.load_ms)
        self._end(ticket, ReloadEvent.SWAP)
        if old is not None:
            self.host.loader.submit(old.close)  # freed off-loop
        self.host.admit_queued()

    def _end(self, ticket: ReloadTicket, event: ReloadEvent, error: str | None = None) -> None:
        if ticket.timer is not None:
            ticket.timer.cancel()
        if ticket.shadow is not None:
            shadow, ticket.shadow = ticket.shadow, None
            self.host.loader.submit(shadow.close)
        if ticket is self.current:
            self.current = None
            self._advance(event, error=error or "")
        if not ticket.outcome.done():
            ticket.outcome.set_result(error)

    async def _restore(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            model = await loop.run_in_executor(self.host.loader, self.factory.build, self.host.params)
        except Exception as e:  # nothing left to serve with
            self.host.lost_model(f"could not restore the old model: {e}")
            return
        self.host.install(model, self.host.params)
        self.host.admit_queued()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # a missing file fails the build, which reports it
        return 0


async def wait_live(ticket: ReloadTicket) -> int:
    """The generation ``ticket`` went live as; raises ReloadFailed if it did not."""
    error = await asyncio.shield(ticket.outcome)
    if error is not None:
        raise ReloadFailed(f"reload to generation {ticket.generation} did not happen: {error}")
    return ticket.generation
