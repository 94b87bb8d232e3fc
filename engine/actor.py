"""The engine actor: one asyncio task owns the model, the context and the slots.

Messages in (mailbox), events out (token queues, futures). Model work runs on a
single low-priority inference thread; shadow models are built on a loader thread.
After every step the actor publishes immutable per-slot snapshots, which STATE_META,
INFO and ``/slots`` read without entering the mailbox — so they answer in
microseconds whatever the engine is doing (the C++ queues them behind the decode).

Reloads (T2/T3/T4 CONFIGURE, model-alias swaps) follow DESIGN.md: build a shadow
model off-loop while the live one serves; when it is ready, stop admitting new
generation work, let in-flight work finish (bounded by the drain timeout, measured
from staging like the C++), swap, free the old model off-loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import tiers
from .buffers import LeasedBuffer
from .jobs import BadInput, EngineBusy, EngineUnavailable, GenJob, GenResult
from .executors import make_inference_executor, make_loader_executor
from .llama_backend import LoadedModel
from .sampling import SamplerParams
from .reload import ModelParams, ReloadInfo, build_model
from .slots import Slot, SlotSnapshot
from .stepper import Running, run_step

log = logging.getLogger("engine.actor")

ENGINE_NAME = "llama-server-hydra"
ENGINE_VERSION = "E1"
CAPABILITIES = ["prefill", "decode", "state_transfer", "expert_mode", "quant_swap", "preset", "tokenizer",
                "model_name", "model_quant", "model_capabilities", "merged_decode"]


@dataclass
class EngineConfig:
    model: ModelParams
    aliases: dict[str, str] = field(default_factory=dict)
    low_priority: bool = True  # inference thread at nice 19 (see DESIGN.md measurements)
    time_slice: float = 0.004  # seconds of model work per step before serving the mailbox
    token_budget: int = 512  # tokens per batched decode (prefill chunks + decode tokens)
    slot_queue: int = 8  # generation jobs waiting per busy slot; 0 = answer BUSY at once
    reload_policy: str = "serve-old"  # serve-old | reject
    reload_mode: str = "shadow"  # shadow | inplace
    drain_timeout: float = 300.0
    resolve_model: Callable[[str], Any] = str
    defaults: dict[str, Any] = field(default_factory=dict)  # T1 parameters


@dataclass
class StateOut:
    n_past: int
    tokens: list[int]
    state: memoryview
    identity: dict[str, Any]
    config_generation: int
    release: Callable[[], None] = lambda: None  # call when ``state`` has been sent


class Engine:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.params = cfg.model
        self.model: LoadedModel | None = None
        self.slots = [Slot(i) for i in range(cfg.model.n_slots)]
        self.generation = 1
        self.reload = ReloadInfo()
        self.startup_stage = "init"  # init | loading_model | ready | failed
        self.startup_error = ""
        self.t1: dict[str, Any] = {"state_chunk_size": tiers.STATE_CHUNK_DEFAULT}
        self.t1.update(cfg.defaults)
        self.expert_mode = "solo"
        self.snapshots: tuple[SlotSnapshot, ...] = ()
        self.identity: dict[str, Any] = {}
        self.stats = {"tokens_generated": 0, "prompt_tokens": 0, "steps": 0, "jobs": 0}
        self._mailbox: asyncio.Queue = asyncio.Queue()
        self._running: dict[int, Running] = {}
        self._infer: concurrent.futures.ThreadPoolExecutor | None = None
        self._loader: concurrent.futures.ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._shadow: LoadedModel | None = None
        self._shadow_params: ModelParams | None = None
        self._reload_token = 0
        self._reload_waiters: list[asyncio.Future] = []
        self._state_buf = LeasedBuffer(bytearray)
        self._stopping = False
        self._publish()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Load the first model (off-loop) and start the actor task."""
        self._infer = make_inference_executor(low_priority=self.cfg.low_priority)
        self._loader = make_loader_executor(low_priority=self.cfg.low_priority)
        loop = asyncio.get_running_loop()
        self.startup_stage = "loading_model"
        t0 = time.perf_counter()
        try:
            self.model = await loop.run_in_executor(self._loader, build_model, self.params)
        except Exception as e:
            self.startup_stage, self.startup_error = "failed", str(e)
            raise
        self.identity = self._identity_of(self.model)
        self.startup_stage = "ready"
        log.info("model loaded in %.0f ms: %s", (time.perf_counter() - t0) * 1000, self.identity.get("model_name"))
        self._publish()
        self._task = asyncio.create_task(self._run(), name="engine-actor")

    async def stop(self, timeout: float = 10.0) -> None:
        """Cancel queued and running work, stop the actor, free models off-loop."""
        self._stopping = True
        for r in self._running.values():
            r.job.cancel()
        self._mailbox.put_nowait(("wake", None, None))
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout)
            except (TimeoutError, asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        for slot in self.slots:
            while slot.queue:
                self._fail(slot.queue.popleft(), EngineUnavailable("engine stopping"))
        loop = asyncio.get_running_loop()
        for m in (self.model, self._shadow):
            if m is not None and self._loader is not None:
                await loop.run_in_executor(self._loader, m.close)
        self.model = self._shadow = None
        for ex in (self._infer, self._loader):
            if ex is not None:
                ex.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ reads (no mailbox)
    @property
    def n_slots(self) -> int:
        return len(self.slots)

    @property
    def n_ctx_slot(self) -> int:
        return self.params.n_ctx_slot

    @property
    def n_vocab(self) -> int:
        return self.model.n_vocab if self.model else 0

    def snapshot(self, slot: int) -> SlotSnapshot:
        return self.snapshots[slot]

    def info(self) -> dict[str, Any]:
        busy = sum(1 for s in self.snapshots if s.is_processing or s.is_transferring)
        return {
            "engine": ENGINE_NAME,
            "version": ENGINE_VERSION,
            "capabilities": list(CAPABILITIES),
            "preset_aliases": sorted(self.cfg.aliases),
            "solo_active": self.expert_mode == "solo",
            "rpc_backend_active": bool(self.params.rpc_servers),
            "mode": self.expert_mode,
            "split_mode": "layer" if self.params.rpc_servers else "none",
            "peer_addr": "",
            "peer_reachable": False,
            "layer_split": "",
            "combined_head_attached": False,
            "pipeline_capable": False,
            "reload": self.reload.as_dict(),
            "reload_policy": self.cfg.reload_policy,
            "reload_mode": self.cfg.reload_mode,
            "config_generation": self.generation,
            "slots_total": self.n_slots,
            "slots_busy": busy,
            "n_ctx_slot": self.params.n_ctx_slot,
            "startup_stage": self.startup_stage,
            "rpc_servers": list(self.params.rpc_servers),
            "devices": self.devices(),
            **{k: v for k, v in self.identity.items() if k not in ("n_params",)},
        }

    def devices(self) -> list[str]:
        """Devices in the ggml backend registry (``RPC0[host:port]`` for remote layers)."""
        if not self.params.rpc_servers:
            return ["CPU"]
        from .ggml_rpc_lib import list_devices

        return [f"{d['name']}[{d['description']}]" if d["name"].startswith("RPC") else d["name"]
                for d in list_devices()]

    @staticmethod
    def _identity_of(model: LoadedModel) -> dict[str, Any]:
        ident = dict(model.identity)
        keep = ("model_path", "model_name", "tokenizer", "model_quant", "model_capabilities")
        out = {k: ident.get(k) for k in keep if k in ident}
        out["model_alias"] = ident.get("model_name", "")
        out["n_vocab"] = model.n_vocab
        return out

    def wire_identity(self) -> dict[str, Any]:
        """The identity keys the C++ puts into STATE_*/PREFILL meta (when non-empty)."""
        keys = ("model_alias", "model_path", "tokenizer", "model_name", "model_quant", "model_capabilities")
        return {k: self.identity[k] for k in keys if self.identity.get(k) not in (None, "", 0)}

    def _publish(self) -> None:
        self.snapshots = tuple(s.snapshot(self.generation, self.identity) for s in self.slots)

    # ------------------------------------------------------------------ requests
    def sampler_params(self, overrides: dict[str, Any] | None = None) -> SamplerParams:
        """T1 defaults, then the request's own fields."""
        t1 = self.t1
        p = SamplerParams(
            temperature=float(t1.get("sampling.temp", 0.8)),
            top_k=int(t1.get("sampling.top_k", 40)),
            top_p=float(t1.get("sampling.top_p", 0.95)),
            min_p=float(t1.get("sampling.min_p", 0.05)),
            seed=t1.get("sampling.seed", t1.get("seed")),
            penalty_repeat=float(t1.get("sampling.penalty_repeat", 1.0)),
        )
        for key, attr in (("temperature", "temperature"), ("temp", "temperature"), ("top_k", "top_k"),
                          ("top_p", "top_p"), ("min_p", "min_p"), ("seed", "seed"),
                          ("repeat_penalty", "penalty_repeat"), ("penalty_repeat", "penalty_repeat")):
            v = (overrides or {}).get(key)
            if v is not None and not isinstance(v, bool) and isinstance(v, (int, float)):
                setattr(p, attr, int(v) if attr in ("top_k", "seed") else float(v))
        return p

    def submit(self, job: GenJob) -> GenJob:
        """Queue a generation job. Raises EngineBusy / EngineUnavailable at once when refused."""
        if self.model is None and self.startup_stage != "ready":
            raise EngineUnavailable(f"no model loaded (stage {self.startup_stage})")
        if not 0 <= job.slot < self.n_slots:
            raise BadInput(f"invalid slot {job.slot}")
        if self.reload.pending and self.cfg.reload_policy == "reject":
            raise EngineBusy("reloading", retry_after_ms=self._retry_after_ms())
        job.done = asyncio.get_running_loop().create_future()
        self._mailbox.put_nowait(("gen", job, None))
        return job

    def _retry_after_ms(self) -> int:
        return int(max(self.reload.load_ms, 500))

    async def _call(self, kind: str, arg: Any = None) -> Any:
        fut = asyncio.get_running_loop().create_future()
        self._mailbox.put_nowait((kind, arg, fut))
        return await fut

    async def state_get(self, slot: int) -> StateOut:
        return await self._call("state_get", slot)

    async def state_put(self, slot: int, tokens: list[int], state: bytes | bytearray | memoryview) -> int:
        return await self._call("state_put", (slot, tokens, state))

    async def erase(self, slot: int) -> None:
        await self._call("erase", slot)

    async def configure(self, cfg: dict[str, Any], sync: bool = False) -> dict[str, Any]:
        """Classify and apply a CONFIGURE; staged tiers start a reload (awaited when ``sync``)."""
        out = await self._call("configure", cfg)
        if sync and out.get("deferred_keys"):
            await self.wait_reload(out["config_generation"])
        return out

    async def wait_reload(self, generation: int) -> None:
        """Wait until the given config generation is live (or its reload failed)."""
        while self.generation < generation and self.reload.pending and self.reload.generation == generation:
            fut = asyncio.get_running_loop().create_future()
            self._reload_waiters.append(fut)
            await fut
        if self.generation < generation:
            raise RuntimeError(f"reload to generation {generation} did not happen: "
                               f"{self.reload.state} {self.reload.error}".strip())

    # ------------------------------------------------------------------ the actor loop
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            while True:
                try:
                    msg = self._mailbox.get_nowait()
                except asyncio.QueueEmpty:
                    break
                await self._handle(msg)
                del msg  # its future may hold a multi-MiB state: do not keep it until the next one
            self._reap_cancelled()
            await self._maybe_swap()
            running = [r for r in self._running.values() if not r.finished]
            if not running:
                self._publish()
                msg = await self._mailbox.get()
                await self._handle(msg)
                del msg
                continue
            try:
                await loop.run_in_executor(self._infer, self._step, running)
            except Exception as e:  # a failed batched decode fails the jobs in it
                log.error("decode step failed: %s", e)
                for r in running:
                    r.error = r.error or e
            self.stats["steps"] += 1
            self._after_step(running)
        for r in list(self._running.values()):
            r.job.cancel()
            self._finish(r)

    def _step(self, running: list[Running]) -> None:
        # llama.cpp caps n_batch at n_ctx; a batch must never exceed what the context accepts
        budget = min(self.cfg.token_budget, self.model.n_batch)
        run_step(self.model, running, n_ctx_slot=self.params.n_ctx_slot, token_budget=budget,
                 time_slice=self.cfg.time_slice)

    def _after_step(self, running: list[Running]) -> None:
        for r in running:
            if r.events:
                for ev in r.events:
                    r.job.events.put_nowait(ev)
                self.stats["tokens_generated"] += len(r.events)
                r.events.clear()
            if r.finished or r.job.cancelled:
                self._finish(r)
        self._publish()

    def _reap_cancelled(self) -> None:
        for r in list(self._running.values()):
            if r.job.cancelled and not r.finished:
                r.stop_reason = "cancelled"
                self._finish(r)
        for slot in self.slots:
            if any(j.cancelled for j in slot.queue):
                for j in [j for j in slot.queue if j.cancelled]:
                    slot.queue.remove(j)
                    self._fail(j, asyncio.CancelledError())

    def _finish(self, r: Running) -> None:
        slot, job = r.slot, r.job
        self._running.pop(slot.id, None)
        slot.finish()
        if r.sampler is not None:
            r.sampler.free()
        job.events.put_nowait(None)
        if job.done is not None and not job.done.done():
            if r.error is not None:
                job.done.set_exception(r.error)
            else:
                now = time.perf_counter()
                pre_end = r.t_prefill_done or now
                self.stats["prompt_tokens"] += r.prompt_tokens - r.cached_tokens
                job.done.set_result(GenResult(
                    slot=slot.id, n_past=slot.n_past, prompt_tokens=r.prompt_tokens,
                    tokens_generated=len(r.generated), stop_reason=r.stop_reason or "cancelled",
                    config_generation=r.generation, identity=self.wire_identity(),
                    prefill_ms=(pre_end - r.t_start) * 1000 if r.t_start else 0.0,
                    decode_ms=(now - pre_end) * 1000, cached_tokens=r.cached_tokens, state=r.state,
                    logits=r.logits, tokens=list(slot.tokens), generated=r.generated, text=bytes(r.text)))
        self._start_next(slot)

    def _fail(self, job: GenJob, exc: BaseException) -> None:
        job.events.put_nowait(None)
        if job.done is not None and not job.done.done():
            if isinstance(exc, asyncio.CancelledError):
                job.done.cancel()
            else:
                job.done.set_exception(exc)

    def _start_next(self, slot: Slot) -> None:
        if slot.busy or self.reload.state == "draining" or self.model is None:
            return
        while slot.queue:
            job = slot.queue.popleft()
            if job.cancelled:
                self._fail(job, asyncio.CancelledError())
                continue
            self._admit(slot, job)
            return

    def _admit(self, slot: Slot, job: GenJob) -> None:
        slot.job = job
        slot.generation = self.generation
        slot.begin("prefill", 0)
        self.stats["jobs"] += 1
        self._running[slot.id] = Running(job, slot, self.generation)

    async def _handle(self, msg: tuple) -> None:
        kind, arg, fut = msg
        try:
            result = await getattr(self, f"_on_{kind}")(arg)
        except Exception as e:
            if fut is not None and not fut.done():
                fut.set_exception(e)
            elif fut is None and kind != "gen":
                log.exception("engine message %s failed", kind)
            return
        if fut is not None and not fut.done():
            fut.set_result(result)

    async def _on_wake(self, _):
        return None

    async def _on_gen(self, job: GenJob) -> None:
        slot = self.slots[job.slot]
        if job.cancelled:
            self._fail(job, asyncio.CancelledError())
        elif slot.busy or self.reload.state == "draining" or slot.queue or self.model is None:
            if len(slot.queue) >= self.cfg.slot_queue:
                self._fail(job, EngineBusy(f"slot {slot.id} is busy and its queue is full"))
            else:
                slot.queue.append(job)
        else:
            self._admit(slot, job)
        self._publish()

    def _require_model(self) -> None:
        if self.model is None:  # an in-place reload freed it and is loading the next one
            raise EngineBusy("no model loaded: an in-place reload is in progress", self._retry_after_ms())

    async def _on_state_get(self, slot_id: int) -> StateOut:
        self._require_model()
        slot = self.slots[slot_id]
        if slot.busy:
            raise EngineBusy(f"slot {slot_id} is busy")
        slot.transferring = True
        slot.begin("state_get", slot.n_past)
        self._publish()
        loop = asyncio.get_running_loop()
        model = self.model
        release = None
        try:
            size = await loop.run_in_executor(self._infer, model.state_seq_size, slot_id)
            buf, release = self._state_buf.lease(size)
            n = await loop.run_in_executor(self._infer, model.state_seq_get_into, slot_id, buf)
        except BaseException:
            if release is not None:
                release()
            raise
        finally:
            slot.transferring = False
            slot.operation = "idle"
        slot.state_size = n
        self._publish()
        return StateOut(slot.n_past, list(slot.tokens), buf[:n].toreadonly(), self.wire_identity(),
                        slot.generation, release)

    async def _on_state_put(self, arg) -> int:
        slot_id, tokens, state = arg
        self._require_model()
        slot = self.slots[slot_id]
        if slot.busy:
            raise EngineBusy(f"slot {slot_id} is busy")
        slot.transferring = True
        slot.begin("state_put", len(tokens))
        self._publish()
        model = self.model

        def load() -> tuple[int, int, int]:
            n = model.state_seq_set(slot_id, state)
            return n, model.seq_pos_max(slot_id), model.state_seq_size(slot_id)

        try:
            n, pos_max, size = await asyncio.get_running_loop().run_in_executor(self._infer, load)
        except Exception:
            slot.tokens, slot.tail = [], []
            raise
        finally:
            slot.transferring = False
            slot.operation = "idle"
        n_kv = pos_max + 1
        # Positions whose token we do not know get -1: they never match a prompt, so prefix
        # reuse stops there, and a continuation cannot re-feed an unknown token.
        slot.tokens = (list(tokens[:n_kv]) + [-1] * max(0, n_kv - len(tokens)))
        slot.tail = []
        slot.state_size = size
        slot.generation = self.generation
        self._publish()
        return n

    async def _on_erase(self, slot_id: int) -> None:
        self._require_model()
        slot = self.slots[slot_id]
        if slot.busy:
            raise EngineBusy(f"slot {slot_id} is processing")
        await asyncio.get_running_loop().run_in_executor(self._infer, self.model.seq_clear, slot_id)
        slot.tokens, slot.tail, slot.state_size = [], [], 0
        self._publish()

    # ------------------------------------------------------------------ configure and reload
    async def _on_configure(self, cfg: dict[str, Any]) -> dict[str, Any]:
        c = tiers.classify(cfg)  # ConfigError propagates: whole request refused
        new_params = None
        if c.staged:
            new_params = self.params.derive(c.staged, self.cfg.resolve_model)  # ValueError → refused
        if c.t1:
            self.t1.update(c.t1)
            self.generation += 1
            self._publish()
        out: dict[str, Any] = {
            "success": True, "tier": c.tier, "params_applied": dict(c.t1),
            "deferred_keys": list(dict.fromkeys(c.deferred_keys)),
            "unrecognized_keys": c.unrecognized_keys, "rejected_keys": c.rejected_keys,
        }
        if "state_chunk_size" in c.t1:
            out["state_chunk_size_applied"] = c.t1["state_chunk_size"]
        if new_params is not None and new_params != self.params:
            self._start_reload(new_params, c)
            out["config_generation"] = self.reload.generation
            out["reload"] = self.reload.state
        else:
            out["config_generation"] = self.generation
            if new_params is not None:
                out["deferred_keys"] = []
                out["unchanged_keys"] = list(dict.fromkeys(c.deferred_keys))
        return out

    def _start_reload(self, params: ModelParams, c: tiers.Classified) -> None:
        loop = asyncio.get_running_loop()
        if self.reload.pending:
            log.info("reload to generation %d superseded", self.reload.generation)
            self._drop_shadow()
        self._reload_token += 1
        token = self._reload_token
        self.reload = ReloadInfo(state="loading", generation=self.generation + 1, target=params.model_path,
                                 tier=c.tier, started_at=time.time(), keys=list(dict.fromkeys(c.deferred_keys)))
        self._shadow_params = params
        loop.call_later(self.cfg.drain_timeout, lambda: self._mailbox.put_nowait(("drain_timeout", token, None)))
        if self.cfg.reload_mode == "inplace":
            self.reload.state = "draining"  # free first, load after: wait for in-flight work
            return
        self._build_shadow(token, params)

    def _build_shadow(self, token: int, params: ModelParams) -> None:
        t0 = time.perf_counter()
        fut = asyncio.get_running_loop().run_in_executor(self._loader, build_model, params)

        def done(f: asyncio.Future) -> None:
            self._mailbox.put_nowait(("shadow_done", (token, f, (time.perf_counter() - t0) * 1000), None))

        fut.add_done_callback(done)

    async def _on_shadow_done(self, arg) -> None:
        token, fut, ms = arg
        try:
            model = fut.result()
        except Exception as e:
            if token == self._reload_token and self.reload.pending:
                self.reload.state, self.reload.error, self.reload.load_ms = "failed", str(e), ms
                log.warning("reload failed, still serving generation %d: %s", self.generation, e)
                self._wake_reload_waiters()
                if self.model is None:  # inplace mode lost its model: restore the old one
                    await self._restore_after_inplace_failure()
            return
        if token != self._reload_token or not self.reload.pending:
            await asyncio.get_running_loop().run_in_executor(self._loader, model.close)  # stale
            return
        self.reload.load_ms = ms
        if self.cfg.reload_mode == "inplace":
            self._swap_in(model, self._shadow_params)
            return
        self._shadow = model
        self.reload.state = "draining"

    async def _on_drain_timeout(self, token: int) -> None:
        if token != self._reload_token or not self.reload.pending:
            return
        busy = [r.slot.id for r in self._running.values()]
        self.reload.state = "dropped"
        self.reload.error = (f"drain timeout of {self.cfg.drain_timeout:g}s passed with slots {busy} still "
                             f"busy; pending config dropped")
        log.warning(self.reload.error)
        self._drop_shadow()
        self._wake_reload_waiters()
        for slot in self.slots:
            self._start_next(slot)

    def _drop_shadow(self) -> None:
        if self._shadow is not None:
            m, self._shadow = self._shadow, None
            self._loader.submit(m.close)

    async def _maybe_swap(self) -> None:
        if self.reload.state != "draining" or self._running or any(s.transferring for s in self.slots):
            return
        loop = asyncio.get_running_loop()
        if self.cfg.reload_mode == "inplace":
            if self.model is not None:
                old, self.model = self.model, None
                self.reload.state = "loading"
                await loop.run_in_executor(self._loader, old.close)
                self._build_shadow(self._reload_token, self._shadow_params)
            return
        if self._shadow is None:
            return
        model, self._shadow = self._shadow, None
        old = self.model
        self._swap_in(model, self._shadow_params)
        if old is not None:
            self._loader.submit(old.close)  # freed off-loop

    def _swap_in(self, model: LoadedModel, params: ModelParams) -> None:
        t0 = time.perf_counter()
        self.model = model
        self.params = params
        self.generation = self.reload.generation
        self.identity = self._identity_of(model)
        self._state_buf.clear()
        for slot in self.slots:  # a new context holds no sequences
            slot.tokens, slot.tail, slot.state_size = [], [], 0
        self.reload.state = "swapped"
        self.reload.swap_ms = (time.perf_counter() - t0) * 1000
        log.info("swapped to config generation %d (%s) after %.0f ms load", self.generation,
                 self.identity.get("model_name"), self.reload.load_ms)
        self._publish()
        self._wake_reload_waiters()
        for slot in self.slots:
            self._start_next(slot)

    async def _restore_after_inplace_failure(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self.model = await loop.run_in_executor(self._loader, build_model, self.params)
        except Exception as e:  # nothing left to serve with
            self.startup_stage, self.startup_error = "failed", f"could not restore the old model: {e}"
            return
        for slot in self.slots:
            slot.tokens, slot.tail = [], []
            self._start_next(slot)

    def _wake_reload_waiters(self) -> None:
        waiters, self._reload_waiters = self._reload_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)
