"""The engine actor: one asyncio task owns the model, the context and the slots.

Typed messages in (the mailbox), events out (token queues, futures). Model work runs on a
single low-priority inference thread; shadow models are built on a loader thread (see
``engine.reloader``). After every step the actor publishes immutable per-slot snapshots,
which STATE_META, INFO and ``/slots`` read without entering the mailbox — so they answer in
microseconds whatever the engine is doing. The wire layers never hold the actor: they hold
``engine.api.EngineApi``, its facade. See ``docs/architecture.md``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from typing import Any, Callable, Mapping

from . import tiers
from .backend import ModelBackend
from .buffers import LeasedBuffer
from .config import EngineConfig, StateOut
from .compute_threads import ComputeThreads, usable_cores
from .erase import DeferredErases
from .executors import InferenceThread, give_way, start_workers
from .jobs import BadInput, EngineBusy, EngineUnavailable, GenJob, GenRequest, JobHandle
from .kv_cache import KvCacheInfo
from .messages import Configure, Erase, StateGet, StatePut, Submit, Wake, WithModel
from .model_params import ModelParams
from .prompt_cache import PromptCache
from .rates import RateWindow
from .reloader import BuildDone, DrainTimeout, Generations, Reloader
from .scheduler import Scheduler, Serving, fail
from .slot_state_ops import SlotStateOps
from .slots import Slot, SlotSnapshot
from .status import ConfigureOutcome, ModelIdentity, ReloadState, ReloadStatus
from .stepper import Running, job_input, run_step, tokenize_on_loop

log = logging.getLogger("engine.actor")


class EngineActor(SlotStateOps):
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.params = cfg.model
        self.model: ModelBackend | None = None
        self.slots = [Slot(i) for i in range(cfg.model.n_slots)]
        self.generations = Generations()
        self.startup_stage = "init"  # init | loading_model | ready | failed
        self.startup_error = ""
        self.t1: dict[str, Any] = {"state_chunk_size": tiers.STATE_CHUNK_DEFAULT}
        self.t1.update(cfg.defaults)
        self.expert_mode = "solo"
        self.snapshots: tuple[SlotSnapshot, ...] = ()
        self.identity = ModelIdentity()
        self.kv_cache: KvCacheInfo | None = None  # the live model's
        self.stats = {"tokens_generated": 0, "prompt_tokens": 0, "steps": 0, "jobs": 0,
                      # llama-server's /metrics counters (hydra_rpc/observability/metrics_llama.py)
                      "prompt_tokens_cached": 0, "prompt_seconds": 0.0, "predicted_seconds": 0.0,
                      "n_decode": 0, "n_busy_slots": 0, "n_tokens_max": 0}
        self.step_rate, self.token_rate = RateWindow(), RateWindow()  # read by the facade's info()
        self.loader: concurrent.futures.Executor | None = None
        self._infer: InferenceThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the actor's: where a running step hands its tokens over
        self._mailbox: asyncio.Queue[tuple[object, asyncio.Future | None]] = asyncio.Queue()
        self.scheduler = Scheduler(self.slots, cfg.slot_queue, self.stats, cfg.slot_prompt_similarity)
        self.cache = PromptCache.build(self.slots, cfg.model, cfg.cache_ram_mib, cfg.slot_save_path,
                                       cfg.ctx_checkpoints, cfg.checkpoint_min_step)
        self._task: asyncio.Task | None = None
        self._state_buf = LeasedBuffer(bytearray)
        self.priorities: dict[str, str] = {}  # thread → scheduling, as set at start (INFO ``priorities``)
        self.compute_threads: ComputeThreads | None = None
        self._stopping = False
        self.erases = DeferredErases(self.slots, cfg.slot_queue, cfg.erase_timeout, cfg.call_later, self._wake)
        self.reloader = Reloader(self, cfg.backend, mode=cfg.reload_mode, drain_timeout=cfg.drain_timeout,
                                 call_later=cfg.call_later)
        self._dispatch: dict[type, Callable[[Any], Any]] = {
            Submit: self._on_submit, StateGet: self._on_state_get, StatePut: self._on_state_put,
            Erase: self._on_erase, Configure: self._on_configure, Wake: self._on_wake, WithModel: self._on_with_model,
            BuildDone: self.reloader.on_build_done, DrainTimeout: self.reloader.on_drain_timeout,
        }
        self._publish()

    # ------------------------------------------------------------------ lifecycle
    def check(self) -> None:
        """Raise RuntimeError when the backend cannot run here (before anything is served)."""
        self.cfg.backend.check()

    async def start(self) -> None:
        """Load the first model (off-loop) and start the actor task."""
        self._infer, self.loader, self.priorities = await start_workers(
            self.cfg.loop_realtime, self.cfg.low_priority, self.cfg.thread_nice)
        self.startup_stage = "loading_model"
        t0 = time.perf_counter()
        try:
            model = await asyncio.get_running_loop().run_in_executor(self.loader, self.cfg.backend.build,
                                                                     self.params)
        except Exception as e:
            self.startup_stage, self.startup_error = "failed", str(e)
            raise
        self.install(model, self.params)
        if self.cfg.adapt_threads:
            self.compute_threads = ComputeThreads(model.n_threads, usable_cores())
        self.startup_stage = "ready"
        log.info("model loaded in %.0f ms: %s", (time.perf_counter() - t0) * 1000, self.identity.model_name)
        self._task = asyncio.create_task(self._run(), name="engine-actor")
        self._task.add_done_callback(self._actor_ended)

    async def stop(self, timeout: float = 10.0) -> None:
        """Cancel queued and running work, stop the actor, free models off-loop."""
        self._stopping = True
        for r in self.scheduler.running.values():
            r.job.cancel()
        self.post(Wake())
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(self._task, timeout)
            except (TimeoutError, asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        self.scheduler.stop_all(EngineUnavailable("engine stopping"), self._serving())
        for slot in self.slots:
            self.erases.answer(slot, 0, EngineUnavailable("engine stopping"))
        if self.loader is not None:
            self.reloader.cancel("engine stopping")
            if self.model is not None:
                await asyncio.get_running_loop().run_in_executor(self.loader, self.model.close)
        self.model = None
        self.cache.close()
        for ex in (self._infer, self.loader):
            if ex is not None:
                ex.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ reads (no mailbox)
    @property
    def ready(self) -> bool:
        """A model is loaded and serving (not during an in-place reload's load)."""
        return self.startup_stage == "ready" and self.model is not None

    @property
    def generation(self) -> int:
        """The config generation new work is served with."""
        return self.generations.live

    @property
    def reload(self) -> ReloadStatus:
        return self.reloader.live_status()

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    @property
    def n_ctx_slot(self) -> int:
        """Tokens one slot may hold (llama-server's rule; 0 before the first model)."""
        return self.kv_cache.n_ctx_slot if self.kv_cache is not None else 0

    # ------------------------------------------------------------------ requests
    def submit(self, request: GenRequest) -> JobHandle:
        """Queue a generation job. Raises EngineBusy / EngineUnavailable / BadInput at once when refused."""
        if self.model is None and self.startup_stage != "ready":
            raise EngineUnavailable(f"no model loaded (stage {self.startup_stage})")
        if request.slot is None:
            if request.append or (request.messages is None and request.prompt is None and request.tokens is None):
                raise BadInput("a request that names no slot needs a prompt (and cannot continue a slot)")
        elif not 0 <= request.slot < self.n_slots:
            raise BadInput(f"invalid slot {request.slot}")
        if self.reloader.pending and self.cfg.reload_policy == "reject":
            raise EngineBusy("reloading", retry_after_ms=self._retry_after_ms())
        self._require_actor()
        job = GenJob(request, done=asyncio.get_running_loop().create_future(), wake=self._wake)
        self.post(Submit(job))
        return JobHandle(job)

    async def submit_admitted(self, request: GenRequest) -> JobHandle:
        """``submit``, then wait until the actor has taken the job (see ``EngineApi.submit_admitted``)."""
        handle = self.submit(request)
        await self._call(Wake())  # the mailbox is FIFO: the Submit before it has been handled
        if handle.finished():
            outcome = await handle.outcome()
            if isinstance(outcome, Exception):
                raise outcome
        return handle

    async def state_get(self, slot: int) -> StateOut:
        return await self._call(StateGet(slot))

    async def state_put(self, slot: int, tokens: list[int], state: bytes | bytearray | memoryview,
                        declared: Any = None) -> int:
        """Restore ``state`` into ``slot``. ``declared``: the sender's ``kv_cache`` (rotation,
        RoPE: what the bytes mean beyond llama.cpp's header), compared before anything changes."""
        return await self._call(StatePut(slot, tokens, state, declared))

    async def erase(self, slot: int) -> int:
        """Clear the slot's sequence; returns the tokens erased. A busy slot is erased when
        its job or transfer ends (engine/erase.py), EngineBusy past the bound."""
        done = await self._call(Erase(slot))
        return await done if isinstance(done, asyncio.Future) else done

    async def with_model(self, fn: Callable[[ModelBackend], Any]) -> Any:
        """``fn(model)`` on the inference thread, between steps (llama-server's /tokenize,
        /detokenize, /apply-template). EngineBusy while an in-place reload has no model."""
        return await self._call(WithModel(fn))

    async def configure(self, cfg: Mapping[str, Any]) -> ConfigureOutcome:
        """Classify and apply a CONFIGURE: T1 at once, staged tiers start (or join) a reload.

        Values of the wrong type or out of range are ``rejected_keys``: nothing refuses the whole
        request.
        """
        return await self._call(Configure(cfg))

    def _retry_after_ms(self) -> int:
        return int(max(self.reload.load_ms, 500))

    def post(self, message: object) -> None:
        self._mailbox.put_nowait((message, None))

    def _wake(self) -> None:
        self.post(Wake())

    async def _call(self, message: object) -> Any:
        self._require_actor()
        fut = asyncio.get_running_loop().create_future()
        self._mailbox.put_nowait((message, fut))
        try:
            return await fut
        finally:
            # A refusal's traceback holds this frame, the frame the future, the future the
            # refusal: a cycle that would keep the caller's frames (a STATE_PUT's buffer) alive
            # until the cyclic GC happens to run.
            message = fut = None

    # ------------------------------------------------------------------ the actor loop
    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        first_tokens_out = False  # the last step gave some job its first token, just written
        while not self._stopping:
            while True:
                try:
                    item = self._mailbox.get_nowait()
                except asyncio.QueueEmpty:
                    break
                await self._handle(*item)
                del item  # its future may hold a multi-MiB state: do not keep it until the next one
            self.scheduler.reap_cancelled(self._serving)
            if self.erases.held():
                await self._erase_deferred()
            await self.reloader.maybe_swap()
            running = self.scheduler.active()
            if not running:
                self._publish()
                if self.compute_threads is not None:
                    self.compute_threads.idle()
                item = await self._mailbox.get()
                await self._handle(*item)
                del item
                first_tokens_out = False
                continue
            threads = self._threads_for_step()
            try:
                await self._infer.call(self._step, running, threads, first_tokens_out)
            except Exception as e:  # a failed batched decode fails the jobs in it
                log.error("decode step failed: %s", e)
                for r in running:
                    r.error = r.error or e
            self.stats["steps"] += 1
            first_tokens_out = any(r.first_token_out for r in running)
            ended = self.scheduler.after_step(running, self._serving)
            now = time.monotonic()
            self.step_rate.record(self.stats["steps"], now)
            self.token_rate.record(self.stats["tokens_generated"], now)
            # A job's result is out: whoever it wakes reads the slot as the job left it.
            if ended:
                self._publish()
            # One turn of the loop for what the step woke (the streams' writers) before the next
            # step starts: done now, while the compute threads wait anyway, their sends do not
            # preempt a compute thread mid-graph — on a host whose cores all compute, that costs
            # twice (its partner spins at the next barrier). +6–13 % tok/s (docs/performance.md).
            await asyncio.sleep(0)
            if not ended:  # tokens only: their writes did not wait for the snapshots
                self._publish()
        self.scheduler.stop_all(EngineUnavailable("engine stopping"), self._serving())

    def _require_actor(self) -> None:
        if self._task is not None and self._task.done():
            raise EngineUnavailable(f"the engine is not running ({self.startup_error or 'stopped'})")

    def _actor_ended(self, task: asyncio.Task) -> None:
        """A bug in the actor must fail its callers, not leave every request hanging."""
        if task.cancelled() or task.exception() is None:
            return
        e = task.exception()
        log.error("engine actor crashed: %r", e, exc_info=e)
        self.lost_model(f"engine actor crashed: {type(e).__name__}: {e}")
        while not self._mailbox.empty():
            _, reply = self._mailbox.get_nowait()
            if reply is not None and not reply.done():
                reply.set_exception(EngineUnavailable(self.startup_error))

    async def _handle(self, message: object, reply: asyncio.Future | None) -> None:
        try:
            result = await self._dispatch[type(message)](message)
        except Exception as e:
            if reply is not None and not reply.done():
                reply.set_exception(e)
            elif reply is None:
                log.exception("engine message %s failed", type(message).__name__)
            # The exception's traceback holds this frame: it must hold neither the reply (which
            # holds the exception: a cycle) nor the message (a STATE_PUT's state).
            message = reply = None
            return
        if reply is not None and not reply.done():
            reply.set_result(result)

    async def _on_wake(self, _: Wake) -> None:
        return None

    async def _on_with_model(self, msg: WithModel) -> Any:
        if self.model is None:
            raise EngineBusy("no model loaded: an in-place reload is in progress", self._retry_after_ms())
        return await asyncio.get_running_loop().run_in_executor(self._infer, msg.fn, self.model)

    def _threads_for_step(self) -> int | None:
        if self.compute_threads is None or self.model is None:
            return None
        self.compute_threads.configured = self.model.n_threads  # the live model's, across reloads
        shadow_loading = self.reloader.status.state is ReloadState.LOADING
        return self.compute_threads.want(loading=shadow_loading)

    def _step(self, running: list[Running], threads: int | None = None, first_tokens_out: bool = False) -> None:
        if first_tokens_out:  # the client woken by a first token reads it first (executors.give_way)
            give_way()
        if threads is not None:
            self.model.set_threads(threads)
        # llama.cpp caps n_batch at n_ctx; a batch must never exceed what the context accepts
        budget = min(self.cfg.token_budget, self.model.n_batch)
        # --context-shift: llama-server keeps n_keep tokens and the BOS (and turns the shift off
        # for a KV cache that cannot move positions, e.g. a sliding window)
        shift = self.params.context_shift and self.model.can_shift
        keep = int(self.t1.get("n_keep", 0)) + 1 if shift else None
        free_idle = functools.partial(self._free_idle_slots, running) if self.params.kv_unified else None
        run_step(self.model, running, n_ctx_slot=self.n_ctx_slot, token_budget=budget, shift_keep=keep,
                 time_slice=self.cfg.time_slice, cache=self.cache, counters=self.stats,
                 hand_over=self._hand_over, should_yield=self._has_mail, free_idle=free_idle)

    def _hand_over(self, batch: list[tuple[Running, list]]) -> None:
        """Inference thread: a running step's tokens, to be delivered on the loop while it goes on."""
        self._loop.call_soon_threadsafe(self.scheduler.deliver, batch)

    def _has_mail(self) -> bool:
        """Inference thread: whether the step should end for the mailbox (a length read)."""
        return not self._mailbox.empty()

    def _publish(self) -> None:
        holds = self.reloader.pending and (self.reloader.blocks_admission or self.model is None
                                           or self.cfg.reload_policy == "reject")
        self.snapshots = tuple(s.snapshot(self.generation, self.identity, holds) for s in self.slots)

    def _serving(self) -> Serving:
        return Serving(open=self.model is not None and not self.reloader.blocks_admission, params=self.params,
                       generation=self.generation, identity=self.identity)

    async def _on_submit(self, msg: Submit) -> None:
        job, model = msg.job, self.model
        if job.slot is None and model is not None and self.cfg.slot_prompt_similarity > 0:
            try:  # the slot is chosen by the prompt's tokens: tokenize now (long inputs on the inference thread)
                on_loop = tokenize_on_loop(job.request, idle=not self.scheduler.running)
                tokens = job_input(model, job, False) if on_loop else \
                    await asyncio.get_running_loop().run_in_executor(self._infer, job_input, model, job, False)
                job.tokenized = (model, tokens)
            except Exception as e:
                fail(job, e)
                return
        self.scheduler.offer(job, self._serving())
        self._publish()

    # ------------------------------------------------------------------ configure
    async def _on_configure(self, msg: Configure) -> ConfigureOutcome:
        c = tiers.classify(dict(msg.cfg))
        tiers.refuse_unbuildable(c, self.params, self.kv_cache, self.cfg.resolve_model, self.cfg.rpc_allow,
                                 getattr(self.cfg.backend, "model_problem", None))
        new_params = self.params.derive(c.staged, self.cfg.resolve_model) if c.staged else None
        if c.t1:
            self.t1.update(c.t1)
            self.generations.apply()
            self._publish()
        deferred = list(dict.fromkeys(c.deferred_keys))
        common = dict(tier=c.tier, params_applied=dict(c.t1), unrecognized_keys=c.unrecognized_keys,
                      rejected_keys=c.rejected_keys, state_chunk_size_applied=c.t1.get("state_chunk_size"))
        if new_params is not None and (new_params != self.params or self.model is None):
            ticket = self.reloader.request(new_params, c.tier, deferred)
            return ConfigureOutcome(deferred_keys=deferred, config_generation=ticket.generation, params=new_params,
                                    reload=self.reload.state, reload_ticket=ticket, **common)
        if new_params is not None and self.reloader.pending:  # asks for what is live: the pending one is moot
            self.reloader.cancel(f"superseded by a config asking for the live model ({', '.join(deferred)})")
        return ConfigureOutcome(deferred_keys=[], config_generation=self.generation, params=self.params,
                                unchanged_keys=deferred if new_params is not None else None, **common)

    # ------------------------------------------------------------------ for the Reloader
    def quiescent(self) -> bool:
        return self.scheduler.quiescent()

    def busy_slots(self) -> list[int]:
        return self.scheduler.busy_slots()

    def install(self, model: ModelBackend | None, params: ModelParams) -> ModelBackend | None:
        """Make ``model`` (None: none, during an in-place reload) the live one; returns the old one."""
        old, self.model, self.params = self.model, model, params
        if model is not None:
            self.identity = ModelIdentity.of(model.identity, model.n_vocab)
            self.kv_cache = model.kv_cache
            self._state_buf.clear()
            self.scheduler.shareable = self.cache.install(model, params)
            for slot in self.slots:  # a new context holds no sequences
                slot.tokens, slot.tail, slot.state_size, slot.last_logits = [], [], 0, None
        self._publish()
        return old

    def admit_queued(self) -> None:
        self.scheduler.admit_queued(self._serving())

    def lost_model(self, error: str) -> None:
        self.startup_stage, self.startup_error = "failed", error
        self.scheduler.stop_all(EngineUnavailable(error), self._serving())
