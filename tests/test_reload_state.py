"""The reload state machine (engine.reload_state) and its guard in the Reloader: every entry
of the table is taken, every other (phase, event) raises, and a Reloader on a fake host walks
the shadow and in-place paths through the table. (The engine around it: test_engine_reload.)

The fake host answers at once; builds run on a real loader thread, so waiting for one polls
with a deadline — nothing here asserts how long anything took."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools

import pytest

from engine.model_params import ModelParams
from engine.reload_state import TRANSITIONS, IllegalReloadTransition, ReloadEvent, next_phase
from engine.reloader import BuildDone, DrainTimeout, Generations, Reloader
from engine.status import ReloadState

IDLE, LOADING, DRAINING = ReloadState.IDLE, ReloadState.LOADING, ReloadState.DRAINING
SWAPPED, FAILED, DROPPED = ReloadState.SWAPPED, ReloadState.FAILED, ReloadState.DROPPED
ILLEGAL = [(phase, event) for phase, event in itertools.product(ReloadState, ReloadEvent)
           if (phase, event) not in TRANSITIONS]


# ---------------------------------------------------------------- the table
@pytest.mark.parametrize(("phase", "event"), list(TRANSITIONS), ids=str)
def test_every_entry_of_the_table_is_taken(phase, event):
    assert next_phase(phase, event) is TRANSITIONS[phase, event]


@pytest.mark.parametrize(("phase", "event"), ILLEGAL, ids=str)
def test_every_other_event_raises(phase, event):
    with pytest.raises(IllegalReloadTransition, match=f"'{event.value}' is not allowed while {phase.value}"):
        next_phase(phase, event)


def test_every_phase_is_reachable_and_pending_ones_can_always_be_dropped():
    reached, frontier = {IDLE}, [IDLE]
    while frontier:
        frontier = [to for (frm, _), to in TRANSITIONS.items() if frm in frontier and to not in reached]
        reached.update(frontier)
    assert reached == set(ReloadState)
    for phase in ReloadState:  # one reload at a time: staging needs the last one ended
        assert ((phase, ReloadEvent.STAGE_BUILD) in TRANSITIONS) == (not phase.pending)
        assert ((phase, ReloadEvent.STAGE_DRAIN) in TRANSITIONS) == (not phase.pending)
        assert ((phase, ReloadEvent.DROP) in TRANSITIONS) == phase.pending


# ---------------------------------------------------------------- a Reloader on a fake host
class FakeModel:
    def __init__(self, path: str):
        self.path = path
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeFactory:
    def __init__(self) -> None:
        self.failing: set[str] = set()

    def build(self, params: ModelParams, progress=None) -> FakeModel:
        if progress is not None:
            progress(0.5)
        if params.model_path in self.failing:
            raise RuntimeError(f"cannot load {params.model_path}")
        return FakeModel(params.model_path)


class FakeTimer:
    def __init__(self, callback) -> None:
        self.callback, self.cancelled = callback, False

    def cancel(self) -> None:
        self.cancelled = True


class FakeHost:
    """The engine actor as the Reloader sees it; ``idle`` says whether in-flight work is done."""

    def __init__(self, model: FakeModel | None) -> None:
        self.model = model
        self.params = ModelParams(model_path="model-a")
        self.generations = Generations()
        self.loader = concurrent.futures.ThreadPoolExecutor(1)
        self.inbox: list[object] = []
        self.idle = False
        self.lost: str | None = None

    def post(self, message: object) -> None:
        self.inbox.append(message)

    def quiescent(self) -> bool:
        return self.idle

    def busy_slots(self) -> list[int]:
        return [] if self.idle else [0]

    def install(self, model, params):
        old, self.model, self.params = self.model, model, params
        return old

    def admit_queued(self) -> None:
        pass

    def lost_model(self, error: str) -> None:
        self.lost = error


@contextlib.contextmanager
def reloader_on(model: FakeModel | None, mode: str = "shadow"):
    host, timers = FakeHost(model), []

    def call_later(delay, callback):
        timers.append(FakeTimer(callback))
        return timers[-1]

    try:
        yield Reloader(host, FakeFactory(), mode=mode, drain_timeout=60.0, call_later=call_later), host, timers
    finally:
        host.loader.shutdown(wait=True)


async def poll(cond, what: str, deadline: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.005)


async def deliver(reloader: Reloader, host: FakeHost) -> object:
    """Hand the reloader the next message the host received (as the actor's mailbox does)."""
    await poll(lambda: host.inbox, "a message for the reloader")
    msg = host.inbox.pop(0)
    if isinstance(msg, BuildDone):
        await reloader.on_build_done(msg)
    else:
        assert isinstance(msg, DrainTimeout)
        await reloader.on_drain_timeout(msg)
    return msg


def params(path: str) -> ModelParams:
    return ModelParams(model_path=path)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_shadow_reload_builds_drains_then_swaps():
    old = FakeModel("model-a")
    with reloader_on(old) as (r, host, timers):
        ticket = r.request(params("model-b"), "T3", ["model_path"])
        assert r.status.state is LOADING and r.pending and not r.blocks_admission
        await deliver(r, host)
        assert r.status.state is DRAINING and ticket.shadow is not None and r.blocks_admission
        await r.maybe_swap()  # still busy
        assert r.status.state is DRAINING and host.model is old
        host.idle = True
        await r.maybe_swap()
        assert r.status.state is SWAPPED and host.model.path == "model-b" and not r.pending
        assert ticket.outcome.result() is None and timers[0].cancelled
        await poll(lambda: old.closed, "the old model freed off-loop")


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_inplace_reload_drains_frees_then_builds_and_swaps():
    old = FakeModel("model-a")
    with reloader_on(old, mode="inplace") as (r, host, timers):
        ticket = r.request(params("model-b"), "T3", ["model_path"])
        assert r.status.state is DRAINING and not host.inbox  # nothing built before the drain
        host.idle = True
        await r.maybe_swap()
        assert r.status.state is LOADING and host.model is None and old.closed
        timers[0].callback()  # posted before the build can report (that takes a loop turn)
        assert isinstance(await deliver(r, host), DrainTimeout)
        assert r.status.state is LOADING  # past the point of no return: the timeout no longer drops it
        assert isinstance(await deliver(r, host), BuildDone)
        assert r.status.state is SWAPPED and host.model.path == "model-b"
        assert ticket.outcome.result() is None


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_failed_build_ends_failed_and_the_old_model_serves():
    old = FakeModel("model-a")
    with reloader_on(old) as (r, host, _):
        r.factory.failing.add("model-b")
        ticket = r.request(params("model-b"), "T3", ["model_path"])
        await deliver(r, host)
        assert r.status.state is FAILED and "cannot load model-b" in r.status.error
        assert host.model is old and ticket.outcome.result() == r.status.error


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_failed_inplace_build_ends_failed_and_the_old_config_is_rebuilt():
    with reloader_on(FakeModel("model-a"), mode="inplace") as (r, host, _):
        r.factory.failing.add("model-b")
        r.request(params("model-b"), "T3", ["model_path"])
        host.idle = True
        await r.maybe_swap()
        assert r.status.state is LOADING and host.model is None
        await deliver(r, host)
        assert r.status.state is FAILED and host.model.path == "model-a" and host.lost is None


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", [LOADING, DRAINING])
async def test_the_drain_timeout_drops_a_pending_reload(when):
    old = FakeModel("model-a")
    with reloader_on(old) as (r, host, timers):
        ticket = r.request(params("model-b"), "T3", ["model_path"])
        if when is DRAINING:
            await deliver(r, host)
        shadow = ticket.shadow
        assert r.status.state is when
        timers[0].callback()  # posted before the build can report (that takes a loop turn)
        assert isinstance(await deliver(r, host), DrainTimeout)
        assert r.status.state is DROPPED and "drain timeout" in ticket.outcome.result()
        assert host.model is old and ticket.shadow is None
        if when is LOADING:  # the build finishes for a dropped ticket: its model is closed, nothing moves
            msg = await deliver(r, host)
            assert r.status.state is DROPPED and msg.result.result().closed
        else:
            await poll(lambda: shadow.closed, "the dropped shadow freed off-loop")


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_newer_config_drops_the_pending_one_and_stages_itself():
    with reloader_on(FakeModel("model-a")) as (r, host, _):
        first = r.request(params("model-b"), "T3", ["model_path"])
        assert r.request(params("model-b"), "T3", ["model_path"]) is first  # the same target joins
        second = r.request(params("model-c"), "T3", ["model_path"])
        assert "superseded" in first.outcome.result() and r.current is second
        assert r.status.state is LOADING and r.status.target == "model-c"
        r.cancel("engine stopping")
        assert r.status.state is DROPPED and second.outcome.result() == "engine stopping"


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_the_guard_refuses_an_illegal_event_and_leaves_the_status_alone():
    with reloader_on(FakeModel("model-a")) as (r, host, _):
        with pytest.raises(IllegalReloadTransition, match="'swap' is not allowed while idle"):
            r._advance(ReloadEvent.SWAP)  # noqa: SLF001
        assert r.status.state is IDLE
        r.request(params("model-b"), "T3", ["model_path"])
        before = r.status
        with pytest.raises(IllegalReloadTransition, match="'stage build' is not allowed while loading"):
            r._advance(ReloadEvent.STAGE_BUILD)  # noqa: SLF001
        assert r.status is before
        r.cancel("done")
