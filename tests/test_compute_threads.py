"""ComputeThreads: the step's thread count follows the cores other processes leave free."""
from __future__ import annotations

import itertools

import pytest

from engine.compute_threads import FRESH_S, SAMPLE_S, ComputeThreads, OtherLoad


class FakeHost:
    """/proc as a script: every read advances the clock by one sample and adds jiffies."""

    def __init__(self) -> None:
        self.t = 0.0
        self.busy = 0.0
        self.own = 0.0
        self.others_cores = 0.0
        self.own_cores = 2.0

    def advance(self, dt: float = SAMPLE_S, own_cores: float | None = None) -> None:
        own = self.own_cores if own_cores is None else own_cores
        self.t += dt
        self.busy += (self.others_cores + own) * dt * 100
        self.own += own * dt * 100

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


def test_after_an_idle_spell_the_first_sample_covers_the_new_work_not_the_spell() -> None:
    host, ct = make()
    assert step(host, ct) == 2
    ct.idle()  # nothing to run: another server decodes on both cores for 3 s, then ends
    host.others_cores = 2.0
    host.advance(3.0, own_cores=0.0)
    host.others_cores = 0.0
    host.advance(0.5, own_cores=0.0)
    assert ct.want(False) == 2  # the spell's load is history: no thread dropped
    assert ct.want(False) == 2  # the second step starts the new window
    host.advance(FRESH_S)
    assert ct.want(False) == 2  # and the first sample of the new work sees a quiet host
    assert ct.others == 0.0


def test_a_host_busy_after_an_idle_spell_takes_a_thread_after_the_first_short_sample() -> None:
    host, ct = make()
    step(host, ct)
    ct.idle()
    host.others_cores = 2.0  # the processes start while we idle, and go on
    host.advance(2.0, own_cores=0.0)
    assert ct.want(False) == 2
    assert ct.want(False) == 2
    host.advance(FRESH_S)
    assert ct.want(False) == 1
    ct.idle()  # still busy after the next spell: the count it had stays
    host.advance(2.0, own_cores=0.0)
    assert ct.want(False) == 1
    assert ct.want(False) == 1
    host.advance(FRESH_S)
    assert ct.want(False) == 1


def test_an_idle_spell_does_not_count_toward_giving_a_thread_back() -> None:
    host, ct = make()
    step(host, ct)
    host.others_cores = 2.0
    assert step(host, ct) == 1
    host.others_cores = 0.0
    assert step(host, ct) == 1  # one quiet sample
    ct.idle()
    host.advance(1.0, own_cores=0.0)
    assert ct.want(False) == 1
    assert ct.want(False) == 1
    host.advance(FRESH_S)
    assert ct.want(False) == 1  # a quiet sample, but the one before the spell does not count
    assert step(host, ct) == 2


def test_the_first_step_after_an_idle_spell_reads_nothing_the_second_starts_the_window() -> None:
    host, ct = make()
    reads = []
    read = host.read
    ct._load._read = lambda: reads.append(host.t) or read()
    step(host, ct)
    ct.idle()
    host.advance(1.0, own_cores=0.0)
    before = list(reads)
    ct.want(False)  # on the path of the request's first token: no /proc read
    assert reads == before
    host.advance(0.01)
    ct.want(False)
    assert reads == [*before, host.t]  # the window starts at the second step


def test_a_shadow_load_takes_one_thread_never_the_last() -> None:
    host, ct = make()
    assert step(host, ct, loading=True) == 1
    assert step(host, ct, loading=False) == 2
    host, ct = make(configured=1)
    assert step(host, ct, loading=True) == 1


def test_it_counts_each_drop_and_the_work_stepped_below_the_configured_count() -> None:
    host, ct = make()
    step(host, ct)
    host.others_cores = 2.0
    assert step(host, ct) == 1 and ct.lowered == 1 and ct.current == 1
    host.others_cores = 0.1
    assert step(host, ct) == 1  # one quiet sample: still below
    assert step(host, ct) == 2 and ct.current == 2
    assert ct.reduced_s == pytest.approx(2 * SAMPLE_S)  # the two steps that ran on one thread
    step(host, ct)
    assert ct.reduced_s == pytest.approx(2 * SAMPLE_S) and ct.lowered == 1


def test_an_idle_spell_below_the_configured_count_is_not_counted_as_reduced_work() -> None:
    host, ct = make()
    step(host, ct)
    host.others_cores = 2.0
    step(host, ct)  # down to one thread
    host.advance(0.2)
    ct.idle()  # the step before it ran 0.2 s on one thread
    host.advance(30.0)  # nothing runs
    ct.want(False)
    assert ct.reduced_s == pytest.approx(0.2)
    host.advance(0.25)
    ct.want(False)
    assert ct.reduced_s == pytest.approx(0.45)


def test_a_shadow_load_counts_as_a_drop() -> None:
    host, ct = make()
    step(host, ct)
    assert step(host, ct, loading=True) == 1 and ct.lowered == 1
    assert step(host, ct) == 2 and ct.reduced_s == pytest.approx(SAMPLE_S)


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
        info = eng.compute_threads_info()  # what /metrics shows an operator
        assert (info.configured, info.current) == (2, 1) and info.lowered >= 1
        f.build_gate.open()
        gen.cancel()
        await until(lambda: eng.actor.model is not old, "the swap")
        await run(eng, GenRequest(1, prompt="after", n_predict=2))
        assert eng.actor.model.threads_now == 2


@pytest.mark.asyncio
async def test_the_engine_says_when_it_goes_idle_and_its_next_step_asks_again():
    from engine.jobs import GenRequest
    from tests.engine_env import run, scripted_engine
    from tests.scripted_backend import until

    calls: list[str] = []

    class Recording(ComputeThreads):
        def idle(self) -> None:
            calls.append("idle")
            super().idle()

        def want(self, loading: bool) -> int:
            calls.append("want")
            return super().want(loading)

    async with scripted_engine() as env:
        eng = env.engine
        eng.actor.compute_threads = Recording(2, 2, OtherLoad(read=lambda: (0.0, 0.0)))
        for prompt in ("one", "two"):
            await run(eng, GenRequest(0, prompt=prompt, n_predict=3))
            await until(lambda: calls[-1:] == ["idle"], "the engine idle after the job")
        # each job's steps asked for their threads, and the engine went idle after them
        spells = [k for k, _ in itertools.groupby(calls)]
        assert spells[-4:] == ["want", "idle", "want", "idle"] and spells.count("want") == 2


def test_the_real_reading_counts_this_process_as_proc_does():
    """``_read_busy`` against /proc itself: this process's CPU as /proc/self/stat has it (within
    the ticks that pass between the two reads), and the host's busy jiffies at least that."""
    import os
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("/proc is Linux's")
    from engine.compute_threads import _read_busy

    end = os.times().user + 0.05
    while os.times().user < end:  # some CPU of our own to count
        pass
    busy, own = _read_busy()
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    proc_own = int(fields[11]) + int(fields[12])
    assert own > 0 and abs(own - proc_own) <= 2
    assert busy >= own
