"""ComputeThreads: the step's thread count follows the cores other processes leave free."""
from __future__ import annotations

import pytest

from engine.compute_threads import SAMPLE_S, ComputeThreads, OtherLoad


class FakeHost:
    """/proc as a script: every read advances the clock by one sample and adds jiffies."""

    def __init__(self) -> None:
        self.t = 0.0
        self.busy = 0.0
        self.own = 0.0
        self.others_cores = 0.0
        self.own_cores = 2.0

    def advance(self) -> None:
        self.t += SAMPLE_S
        self.busy += (self.others_cores + self.own_cores) * SAMPLE_S * 100
        self.own += self.own_cores * SAMPLE_S * 100

    def read(self):
        return self.busy, self.own


def make(configured: int = 2, cores: int = 2):
    host = FakeHost()
    load = OtherLoad(read=host.read, clock=lambda: host.t)
    load._tick = 100
    return host, ComputeThreads(configured, cores, load, clock=lambda: host.t)


def step(host: FakeHost, ct: ComputeThreads, loading: bool = False) -> int:
    host.advance()
    return ct.want(loading)


def test_idle_host_keeps_every_thread() -> None:
    host, ct = make()
    assert [step(host, ct) for _ in range(4)] == [2, 2, 2, 2]


def test_other_processes_take_threads_at_once_and_give_them_back_after_two_samples() -> None:
    host, ct = make()
    step(host, ct)
    host.others_cores = 2.0  # two CPU-bound processes beside us
    assert step(host, ct) == 1
    host.others_cores = 0.1
    assert step(host, ct) == 1  # one quiet sample is not enough
    assert step(host, ct) == 2


def test_a_shadow_load_takes_one_thread_never_the_last() -> None:
    host, ct = make()
    assert step(host, ct, loading=True) == 1
    assert step(host, ct, loading=False) == 2
    host, ct = make(configured=1)
    assert step(host, ct, loading=True) == 1


def test_unreadable_proc_changes_nothing() -> None:
    ct = ComputeThreads(4, 4, OtherLoad(read=lambda: None), clock=iter(range(0, 100)).__next__)
    assert {ct.want(False) for _ in range(10)} == {4}


@pytest.mark.asyncio
async def test_steps_give_a_shadow_load_one_thread_and_take_it_back():
    from engine.jobs import GenRequest
    from tests.engine_env import long_generation, run, scripted_engine
    from tests.scripted_backend import until

    async with scripted_engine(n_ctx_slot=4096) as env:
        eng, f = env.engine, env.factory
        quiet = OtherLoad(read=lambda: (0.0, 0.0))  # no other process on this "host"
        eng.actor.compute_threads = ComputeThreads(2, 2, quiet)
        old = env.model
        gen = await long_generation(eng, 0)
        # the slot holds the job before its first step runs; the step sets the threads
        await until(lambda: old.threads_now == 2, "the steps on two threads")
        f.build_gate.close()
        await eng.configure({"model_path": "model-b"})
        await until(lambda: f.build_gate.waiting == 1, "the shadow build")
        steps = eng.stats["steps"]
        await until(lambda: eng.stats["steps"] > steps + 1, "steps while it loads")
        assert old.threads_now == 1
        f.build_gate.open()
        gen.cancel()
        await until(lambda: eng.actor.model is not old, "the swap")
        await run(eng, GenRequest(1, prompt="after", n_predict=2))
        assert eng.actor.model.threads_now == 2
