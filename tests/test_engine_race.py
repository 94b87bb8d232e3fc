"""Issue 13 item 11: config generations are unique and monotonic, and a request that names a
model or a config is served by exactly that one or fails.

A hypothesis state machine interleaves CONFIGURE T1/T2/T3, SWAP_QUANT, PREFILLs with
``model`` / ``hydra_config`` (left running while the next steps happen), STATE_GET/PUT, a
long generation that keeps reloads draining, and drain timeouts, on the scripted backend in
step mode: the engine decodes only when a rule lets a step run (``step``, or a call the actor
answers between two steps), so engine steps are part of the interleaving hypothesis explores.
Every scripted state is stamped with the model that produced it, so a PREFILL's captured
state says which model really served it. Then the race as it was reported, over TCP with
real models.
"""
from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from codec.enums import Op
from engine.jobs import EngineBusy, GenRequest, JobHandle, ModelChanged, ReloadFailed
from engine.model_params import ModelParams
from engine.status import ReloadState
from hydra_rpc.client import HydraClient
from tests.engine_env import scripted_engine
from tests.helpers import poll_until, serving
from tests.scripted_backend import ScriptedFactory, parse_state

ALIASES = {"a": "model-a", "b": "model-b", "c": "model-c", "bad": "model-bad"}
N_SLOTS = 3
# PREFILL (model, hydra_config) pairs, as clients send them
REQUESTS = [("b", None), ("c", None), ("a", None), ("bad", None), ("not-an-alias", None), (None, None),
            (None, {"model_path": "model-b"}), (None, {"model": "model-c", "sampling.temp": 0.3}),
            (None, {"n_ctx": 2048}), (None, {"n_ctx": 4096}), ("b", {"n_ctx": 2048}), (None, {"n_predict": 8})]
STAGED = [{"model_path": "model-b"}, {"model_path": "model-c"}, {"model": {"path": "model-a"}},
          {"model_path": "model-bad"}, {"n_ctx": 2048}, {"n_ctx": 4096}]


def new_loop() -> asyncio.AbstractEventLoop:
    if os.environ.get("HYDRA_TEST_LOOP", "uvloop") == "asyncio":
        return asyncio.new_event_loop()
    import uvloop

    return uvloop.new_event_loop()


@dataclass
class Prefill:
    task: asyncio.Task
    slot: int
    alias: str | None
    hydra_config: dict | None
    checked: bool = False


class ReloadRace(RuleBasedStateMachine):
    reload_mode = "shadow"

    def __init__(self) -> None:
        super().__init__()
        self.loop = new_loop()
        factory = ScriptedFactory(fail={"model-bad"})
        self._env_cm = scripted_engine(n_slots=N_SLOTS, n_ctx_slot=4096, aliases=dict(ALIASES), backend=factory,
                                       reload_mode=self.reload_mode, slot_queue=4, stepped=True)
        self.env = self.loop.run_until_complete(self._env_cm.__aenter__())
        self.engine = self.env.engine
        self.prefills: list[Prefill] = []
        self.params_of: dict[int, ModelParams] = {}  # config generation → the model config it names
        self.last_live = self.engine.generation
        self.blocker: JobHandle | None = None

    def teardown(self) -> None:
        try:
            if self.blocker is not None:
                self.blocker.cancel()
            self.env.timers.fire()  # nothing stays pending
            self.call(self.engine.configure({}))  # wake the actor: cancelled queued jobs leave
            self.run(self.env.advance(lambda: all(p.task.done() for p in self.prefills), "every PREFILL settled"))
            self.check_prefills()
        finally:
            self.loop.run_until_complete(self._env_cm.__aexit__(None, None, None))
            self.loop.close()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def call(self, coro):
        """A mailbox call: the actor answers it between two steps (steps are let run until then)."""
        return self.run(self.env.call(coro))

    def settle(self) -> None:
        """Builds take no time here: wait for the reload to leave ``loading`` (the actor takes a
        built model between two steps: steps are let run until then)."""
        self.run(self.env.advance(lambda: self.engine.reload.state is not ReloadState.LOADING, "the build done"))

    def record(self, generation: int, params: ModelParams) -> None:
        known = self.params_of.setdefault(generation, params)
        assert known == params, f"config generation {generation} names two configs: {known} and {params}"

    # ------------------------------------------------------------------ rules
    @rule(temp=st.sampled_from([0.1, 0.5, 0.9]))
    def configure_t1(self, temp: float) -> None:
        out = self.call(self.engine.configure({"sampling.temp": temp}))
        assert out.reload_ticket is None and out.tier == "T1"
        assert out.config_generation not in self.params_of, f"T1 reused generation {out.config_generation}"
        self.record(out.config_generation, out.params)

    @rule(cfg=st.sampled_from(STAGED))
    def configure_staged(self, cfg: dict) -> None:
        out = self.call(self.engine.configure(cfg))
        self.record(out.config_generation, out.params)
        self.settle()

    @rule(alias=st.sampled_from(sorted(ALIASES)))
    def swap_quant(self, alias: str) -> None:
        out = self.call(self.engine.swap_model(alias))
        self.record(out.config_generation, out.params)
        self.settle()

    @rule(slot=st.integers(0, N_SLOTS - 1), request=st.sampled_from(REQUESTS))
    def prefill(self, slot: int, request: tuple) -> None:
        alias, hydra_config = request
        task = self.env.task(self.loop.create_task(self._prefill(slot, alias, hydra_config)))
        self.prefills.append(Prefill(task, slot, alias, hydra_config))
        self.run(self.env.advance(lambda: task.done() or self.engine.reload.state is not ReloadState.LOADING,
                                  "started"))

    async def _prefill(self, slot: int, alias: str | None, hydra_config: dict | None):
        choice = await self.engine.select_model(alias, hydra_config)
        job = GenRequest(slot, prompt="prefill me", n_predict=0, capture_state=True, params=choice.params)
        job = self.engine.submit(job)
        return choice, await job.result()

    @rule(src=st.integers(0, N_SLOTS - 1), dst=st.integers(0, N_SLOTS - 1))
    def state_transfer(self, src: int, dst: int) -> None:
        async def transfer() -> None:
            out = await self.engine.state_get(src)
            try:
                tokens, state = out.tokens, bytes(out.state)
            finally:
                out.release()
            before = self.engine.generation
            await self.engine.state_put(dst, tokens, state)
            n_past = self.engine.snapshot(dst).n_past
            # A reload that waited for the transfer to finish may go live before this task runs
            # again: the new context holds no sequences. Anything else keeps what was put.
            assert n_past == len(tokens) or (n_past == 0 and self.engine.generation != before), \
                (n_past, len(tokens), before, self.engine.generation)

        try:
            self.call(transfer())
        except EngineBusy:
            pass  # the slot was busy (or an in-place reload had no model): refused, nothing changed

    @precondition(lambda self: self.blocker is None)
    @rule(slot=st.integers(0, N_SLOTS - 1))
    def start_long_generation(self, slot: int) -> None:
        """Keeps a reload draining (in-flight work finishes first) while other steps happen."""
        async def submit() -> JobHandle:
            return self.engine.submit(GenRequest(slot, prompt="long", n_predict=4000))

        self.blocker = self.run(submit())

    @precondition(lambda self: self.blocker is not None)
    @rule()
    def stop_long_generation(self) -> None:
        job, self.blocker = self.blocker, None
        job.cancel()
        self.call(self.engine.configure({}))  # a queued job leaves when the actor next looks
        self.run(self.env.advance(job.finished, "the long generation ended"))
        self.settle()

    @rule()
    def drain_timeout(self) -> None:
        self.env.timers.fire()
        self.call(self.engine.configure({}))  # the timeout message is handled before this reply
        self.settle()

    @rule()
    def step(self) -> None:
        """Let one engine step run, if one is held (a running PREFILL or long generation)."""
        async def one() -> None:
            await self.env.settled()
            if self.env.held:
                await self.env.step()

        self.run(one())

    # ------------------------------------------------------------------ invariants
    @invariant()
    def generation_is_monotonic_and_names_one_config(self) -> None:
        live = self.engine.generation
        assert live >= self.last_live, f"config generation went back from {self.last_live} to {live}"
        self.last_live = live
        if self.engine.actor.model is not None:
            self.record(live, self.engine.params)

    @invariant()
    def prefills_were_served_by_what_they_named(self) -> None:
        self.check_prefills()

    def check_prefills(self) -> None:
        for p in self.prefills:
            if p.checked or not p.task.done():
                continue
            p.checked = True
            if p.task.cancelled() or p.task.exception() is not None:
                exc = None if p.task.cancelled() else p.task.exception()
                assert isinstance(exc, (ReloadFailed, ModelChanged, EngineBusy)), repr(exc)
                event(f"PREFILL failed: {type(exc).__name__}")
                continue
            choice, res = p.task.result()
            event(f"PREFILL served ({'pinned' if choice.params is not None else 'any model'})")
            serial, _ = parse_state(bytes(res.state))
            served = next(m for m in self.env.factory.built if m.serial == serial)
            self.record(res.config_generation, served.params)
            assert res.identity.model_path == served.params.model_path
            named = p.hydra_config is not None or p.alias in ALIASES
            assert (choice.params is not None) == named
            if not named:
                continue
            assert served.params == choice.params, f"{p.alias} {p.hydra_config} served by {served.params}"
            cfg = p.hydra_config or {}
            want_path = ALIASES.get(p.alias) or cfg.get("model_path") or cfg.get("model")
            if want_path is not None:
                assert served.params.model_path == want_path
            if "n_ctx" in cfg:
                assert served.params.n_ctx == cfg["n_ctx"]


class InplaceReloadRace(ReloadRace):
    reload_mode = "inplace"


_settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestReloadRace = ReloadRace.TestCase
TestReloadRace.settings = _settings
TestInplaceReloadRace = InplaceReloadRace.TestCase
TestInplaceReloadRace.settings = _settings


# ---------------------------------------------------------------------- the reported race, over TCP
@pytest.mark.asyncio
async def test_t1_configure_during_a_prefill_reload_is_not_answered_by_the_old_model(tiny_model_b_path):
    """SchedulerV2 sends a T1 CONFIGURE while a PREFILL's ``hydra_config`` reloads the model: the
    T1 gets a generation of its own and the PREFILL is answered by the model it named."""
    from engine.model_files import ensure_tiny_model

    small = str(ensure_tiny_model("small"))
    with serving("--model", small, "--no-http", "--ctx", "16384",
                 "--log-level", "WARNING") as server:
        c = await HydraClient.connect(server.host, server.port)
        busy = await HydraClient.connect(server.host, server.port)
        pre = await HydraClient.connect(server.host, server.port)
        try:
            # a generation that keeps the reload draining until we cancel it
            await busy.send(Op.DECODE, "0", json.dumps({"n_predict": 10**6, "stream": False,
                                                        "messages": [{"role": "user", "content": "go"}]}).encode())
            await poll_until(lambda: c.request(Op.STATE_META, "0"), lambda r: r.meta["is_processing"], 30)
            body = {"messages": [{"role": "user", "content": "hi"}], "hydra_config": {"model_path": tiny_model_b_path}}
            prefill = asyncio.create_task(pre.request(Op.PREFILL, "1", json.dumps(body).encode(), timeout=120))
            reload = (await poll_until(lambda: c.request(Op.INFO),
                                       lambda r: r.meta["reload"]["state"] == "draining", 30)).meta["reload"]
            t1 = await c.request(Op.CONFIGURE, "0", json.dumps({"sampling.temp": 0.7}).encode())
            assert t1.ok and t1.meta["config_generation"] != reload["generation"]
            # the PREFILL still waits for its model (a state, not a timing: the reload cannot swap while slot 0 runs)
            assert (await c.request(Op.INFO)).meta["reload"]["state"] == "draining" and not prefill.done()
            busy.writer.transport.abort()  # the generation is cancelled, the drain completes
            r = await prefill
            assert r.ok and r.meta["model_name"] == "hydra-tiny-b", r.meta
            assert r.meta["config_generation"] > t1.meta["config_generation"]
        finally:
            await busy.close()
            await pre.close()
            await c.close()
