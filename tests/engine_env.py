"""An engine (its facade, ``EngineApi``) on the scripted backend, for step-by-step actor tests.

Step mode — ``scripted_engine(stepped=True)`` closes the decode gate, so every batched decode
(one per engine step: ``time_slice`` 0) waits until the test lets exactly that step run:

    await env.step(n=1)        # release held steps one at a time; returns the last step's number
                               # once it is published and the actor has settled again
    await env.steps_done(n)    # step n has been published
    await env.settled()        # the actor waits for the test: at a held decode, or idle
    await env.call(coro)       # a mailbox call (configure, erase, …): answered between two steps
    await env.finish(handle)   # step until the job ends; its result (env.run: submit + finish)
    await env.builds_done(n)   # n model builds are back: their BuildDone is in the mailbox
    await env.wait_for(pred, what)  # re-checked at every event below; AssertionError at the deadline

No polling: hooks on the actor (white-box, tests only) notify the factory's ``changed`` signal
when a message is posted or handled, a snapshot is published, the actor goes idle or its task
ends; the scripted backend notifies it when a gate, a build or a model changes.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from engine.api import EngineApi
from engine.config import EngineConfig
from engine.jobs import GenRequest, GenResult, JobHandle
from engine.model_params import ModelParams
from engine.reloader import BuildDone

from tests.scripted_backend import ManualTimers, ScriptedFactory
from tests.signals import Signal

MAX_STEPS = 10_000  # ``advance`` gives up after this many steps: a job that never ends
SPIN_STEPS = 100  # steps without a decode to hold while the test waits: a stepped engine that spins


class ActorWatch:
    """Wraps a few of the actor's methods (instance attributes shadow them) to notify ``signal``
    and count: messages posted and handled (by type), the last step published, idle."""

    def __init__(self, actor: Any, signal: Signal):
        self.actor, self.signal = actor, signal
        self.posted: collections.Counter[type] = collections.Counter()
        self.handled: collections.Counter[type] = collections.Counter()
        self.published_step = 0  # the engine's step count at its latest publish
        self._idle = False  # awaiting its mailbox with nothing to run
        notify = signal.notify
        publish, handle, post, get = actor._publish, actor._handle, actor.post, actor._mailbox.get

        def published() -> None:
            publish()
            self.published_step = actor.stats["steps"]
            notify()

        async def handled(message: object, reply: asyncio.Future | None) -> None:
            kind = type(message)
            try:
                await handle(message, reply)
            finally:
                message = reply = None  # as the actor's own: a traceback must not keep a state alive
                self.handled[kind] += 1
                notify()

        def posted(message: object) -> None:
            self.posted[type(message)] += 1
            notify()  # first: the waiter runs before the actor, woken by the put, takes the message
            post(message)

        async def idle_get() -> Any:
            self._idle = True
            notify()
            try:
                return await get()
            finally:
                self._idle = False

        actor._publish, actor._handle, actor.post, actor._mailbox.get = published, handled, posted, idle_get

    def started(self) -> None:
        self.actor._task.add_done_callback(lambda _: self.signal.notify())  # after the actor's own

    @property
    def idle(self) -> bool:
        """The actor waits for a message and none is there: nothing happens until one comes."""
        return self._idle and self.actor._mailbox.empty()


@dataclass
class Env:
    engine: EngineApi
    factory: ScriptedFactory
    timers: ManualTimers
    watch: ActorWatch

    @property
    def model(self):
        """The live scripted model."""
        return self.engine.actor.model

    @property
    def actor(self) -> Any:
        return self.engine.actor

    @property
    def held(self) -> bool:
        """A decode step waits at the (closed) decode gate: the actor is inside that step."""
        return self.factory.decode_gate.held > 0

    async def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        """Until ``predicate()`` holds: re-checked at every event of the actor and the backend.
        It must read only what changes with such an event (a task's ``done()`` turns true a
        loop turn after what it awaited: start it with ``env.task``)."""
        await self.factory.changed.wait_for(predicate, what)

    def task(self, coro: Awaitable[Any]) -> asyncio.Task:
        """A task whose end is an event ``wait_for`` sees."""
        task = asyncio.ensure_future(coro)
        task.add_done_callback(lambda _: self.factory.changed.notify())
        return task

    async def settled(self, what: str = "the actor settled") -> None:
        """Until the actor can do nothing more without the test: a decode step is held (the
        actor did all it does between two steps), or it is idle with an empty mailbox. In step
        mode an engine that keeps stepping with nothing to decode fails at once (it spins)."""
        first = self.watch.published_step
        closed = self.factory.decode_gate.closed

        def spins() -> bool:
            return closed and self.watch.published_step - first > SPIN_STEPS

        await self.wait_for(lambda: self.held or self.watch.idle or spins(), what)
        assert not spins(), f"{what}: {SPIN_STEPS} steps ran with no decode to hold (the engine spins)"

    async def steps_done(self, n: int) -> None:
        """Until the engine has published step ``n`` (counted from its start)."""
        await self.wait_for(lambda: self.watch.published_step >= n, f"step {n} published")

    async def step(self, n: int = 1) -> int:
        """Let exactly ``n`` decode steps run, one at a time: each returns once published and the
        actor settled again (held at the next step, or idle). Returns the last step's number."""
        gate = self.factory.decode_gate
        assert gate.closed, "env.step() needs step mode: scripted_engine(stepped=True)"
        for _ in range(n):
            await self.settled()
            assert self.held, "no step to release: the actor is idle"
            in_flight = self.actor.stats["steps"] + 1  # not counted until the held step returns
            gate.release(1)
            await self.steps_done(in_flight)
            await self.settled()
        return self.watch.published_step

    async def advance(self, predicate: Callable[[], bool], what: str) -> int:
        """Release held steps one at a time until ``predicate()`` holds (waiting for events, not
        steps, while none is held); for what takes steps but no known number of them. Returns
        the number of steps released."""
        for n in range(MAX_STEPS):
            await self.wait_for(lambda: predicate() or self.held, what)
            if predicate():
                return n
            await self.step()
        raise AssertionError(f"{what}: not after {MAX_STEPS} steps")

    async def call(self, call: Awaitable[Any]) -> Any:
        """Await a mailbox call (configure, erase, state_get, …) while the actor may be held in a
        step: the actor takes messages between two steps, so held steps are released until the
        call is answered. Its result, or its exception."""
        task = self.task(call)
        await asyncio.sleep(0)  # the task's first turn posts its message (it does not suspend before)
        try:
            await self.advance(task.done, "the call answered")
        finally:
            task.cancel()  # a no-op once done; never left behind by a failed test
        return task.result()

    async def finish(self, job: JobHandle) -> GenResult:
        """Step until ``job`` ends; its result (raises what the job failed with)."""
        await self.advance(job.finished, f"job {job.id} finished")
        return await job.result()

    async def run(self, request: GenRequest) -> GenResult:
        return await self.finish(self.engine.submit(request))

    async def builds_done(self, n: int) -> None:
        """Until ``n`` builds (of reloads, since start) have come back to the actor's mailbox."""
        await self.wait_for(lambda: self.watch.posted[BuildDone] >= n, f"{n} build(s) done")

    async def long_generation(self, slot: int) -> JobHandle:
        """A generation of thousands of steps (cancel it to end it): keeps ``slot`` busy, and so
        keeps a reload draining, while the test does other things. Needs ``n_ctx_slot=4096``.
        Returns once the slot shows the job (in step mode: its first step held)."""
        eng = self.engine
        job = eng.submit(GenRequest(slot, prompt="busy", n_predict=4000))
        await self.advance(lambda: eng.snapshot(slot).job_id == job.id, f"slot {slot} generating")
        if self.factory.decode_gate.closed:
            await self.settled()
        return job


_envs: dict[Any, Env] = {}  # actor → its Env, while it runs


@contextlib.asynccontextmanager
async def scripted_engine(n_slots: int = 2, n_ctx_slot: int = 64, stepped: bool = False,
                          **cfg: object) -> AsyncIterator[Env]:
    """time_slice 0: every step is exactly one batched decode, so tests can count steps.
    ``stepped``: every step waits for ``env.step()`` (the decode gate is closed)."""
    factory = cfg.pop("backend", None) or ScriptedFactory()
    timers = ManualTimers()
    config = dict(model=ModelParams("model-a", n_ctx=n_ctx_slot, n_slots=n_slots, n_batch=32),
                  aliases={"b": "model-b", "c": "model-c", "a": "model-a"}, backend=factory, low_priority=False,
                  call_later=timers, time_slice=0.0, slot_queue=2)
    config.update(cfg)
    engine = EngineApi(EngineConfig(**config))
    watch = ActorWatch(engine.actor, factory.changed)
    await engine.start()
    watch.started()
    if stepped:
        factory.decode_gate.close()
    env = _envs[engine.actor] = Env(engine, factory, timers, watch)
    try:
        yield env
    finally:
        del _envs[engine.actor]
        factory.decode_gate.open()
        factory.build_gate.open()
        await engine.stop()


async def run(engine: EngineApi, request: GenRequest) -> GenResult:
    return await engine.submit(request).result()


async def long_generation(engine: EngineApi, slot: int) -> JobHandle:
    """``Env.long_generation`` of the scripted engine behind ``engine``."""
    return await _envs[engine.actor].long_generation(slot)
