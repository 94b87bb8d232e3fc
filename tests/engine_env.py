"""An Engine on the scripted backend, for step-by-step actor tests."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import AsyncIterator

from engine.actor import Engine, EngineConfig
from engine.jobs import GenJob, GenResult
from engine.model_params import ModelParams

from tests.scripted_backend import ManualTimers, ScriptedFactory


@dataclass
class Env:
    engine: Engine
    factory: ScriptedFactory
    timers: ManualTimers

    @property
    def model(self):
        """The live scripted model."""
        return self.engine.model


@contextlib.asynccontextmanager
async def scripted_engine(n_slots: int = 2, n_ctx_slot: int = 64, **cfg: object) -> AsyncIterator[Env]:
    """time_slice 0: every step is exactly one batched decode, so tests can count steps."""
    factory = cfg.pop("backend", None) or ScriptedFactory()
    timers = ManualTimers()
    config = dict(model=ModelParams("model-a", n_ctx=n_ctx_slot, n_slots=n_slots, n_batch=32),
                  aliases={"b": "model-b", "c": "model-c", "a": "model-a"}, backend=factory, low_priority=False,
                  call_later=timers, time_slice=0.0, slot_queue=2)
    config.update(cfg)
    engine = Engine(EngineConfig(**config))
    await engine.start()
    try:
        yield Env(engine, factory, timers)
    finally:
        factory.decode_gate.open()
        factory.build_gate.open()
        await engine.stop()


async def run(engine: Engine, job: GenJob) -> GenResult:
    engine.submit(job)
    return await job.result()


async def long_generation(engine: Engine, slot: int) -> GenJob:
    """A generation of thousands of steps (cancel it to end it): keeps ``slot`` busy, and so
    keeps a reload draining, while the test does other things. Needs ``n_ctx_slot=4096``."""
    from tests.scripted_backend import until

    job = engine.submit(GenJob(slot, prompt="busy", n_predict=4000))
    await until(lambda: engine.snapshot(slot).job_id == job.id, f"slot {slot} generating")
    return job
