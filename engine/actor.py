"""The engine actor: one asyncio task owns the model, the context and the slots.

Typed messages in (the mailbox), events out (token queues, futures). Model work runs on a
single low-priority inference thread; shadow models are built on a loader thread (see
``engine.reloader``). After every step the actor publishes immutable per-slot snapshots,
which STATE_META, INFO and ``/slots`` read without entering the mailbox — so they answer in
microseconds whatever the engine is doing. See ``docs/architecture.md``.

The public face — all the wire layer (``hydra_rpc``) uses:

lifecycle  ``check()``, ``start()``, ``stop()``
reads      ``ready``, ``startup_stage``, ``startup_error``, ``generation``, ``identity``,
           ``kv_cache`` (KvCacheInfo: what a restore must match), ``n_slots``, ``n_ctx_slot``, ``n_vocab``,
           ``max_state_size``, ``snapshots``/``snapshot(slot)``,
           ``reload``, ``info()``, ``stats``, ``state_chunk_size``, ``default_n_predict``,
           ``aliases``, ``model_states()``, ``cache.info()`` (the prompt cache),
           ``queued_unassigned`` (jobs naming no slot, waiting for any)
requests   ``sampling_for(fields)``, ``select_model(alias, hydra_config)``, ``submit(job)``
           (cancel with ``job.cancel()``; ``job.slot`` None: the engine picks the slot; a stream
           writer reports a client that is not reading with ``job.set_client_blocked()``),
           ``submit_admitted(job)``, ``state_get(slot)``, ``state_put(slot, tokens, state)``, ``erase(slot)``
           (slot files: ``engine.slot_files``), ``configure(cfg)``, ``swap_model(alias)``,
           ``wait_reload(ticket)``, ``set_expert_mode(mode)``
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any, Callable, Mapping

from codec.errors import CodecError

from . import tiers
from .backend import ModelBackend
from .chat.formats import ChatFormat, detect_format
from .buffers import LeasedBuffer
from .config import EngineConfig, StateOut
from .compute_threads import ComputeThreads, usable_cores
from .erase import DeferredErases
from .executors import InferenceThread, start_workers
from .jobs import BadInput, EngineBusy, EngineUnavailable, GenJob
from .kv_cache import BadDeclaration, KvCacheInfo, KvStateMismatch, restore_state
from .messages import Configure, Erase, StateGet, StatePut, Submit, Wake, WithModel
from .model_params import ModelParams, resolve_path
from .prompt_cache import PromptCache
from .rates import RateWindow, rate
from .reloader import BuildDone, DrainTimeout, Generations, Reloader, ReloadTicket, wait_live
from .reasoning_budget import ReasoningBudget
from .sampling import GrammarSpec, SamplerParams, merge_sampling
from .scheduler import Scheduler, Serving, fail
from .slots import Slot, SlotSnapshot
from .status import ConfigureOutcome, EngineInfo, ModelChoice, ModelIdentity, ReloadState, ReloadStatus
from .stepper import Running, job_input, run_step

log = logging.getLogger("engine.actor")


class Engine:
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
        self._step_rate, self._token_rate = RateWindow(), RateWindow()
        self.loader: concurrent.futures.Executor | None = None
        self._infer: InferenceThread | None = None
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

    @property
    def n_vocab(self) -> int:
        return self.identity.n_vocab

    @property
    def chat_syntax(self) -> ChatFormat:
        """The live model's chat template format (tool calls, reasoning); generic before a model."""
        model = self.model
        return model.chat_syntax if model is not None else detect_format(None)

    @property
    def reasoning_format(self) -> str:
        """How chat answers split ``<think>`` blocks unless a request says (--reasoning-format)."""
        return self.cfg.reasoning_format

    @property
    def default_grammar(self) -> GrammarSpec | None:
        """The grammar of requests that bring none (--grammar, --json-schema)."""
        return self.cfg.default_grammar

    @property
    def reasoning_budget(self) -> ReasoningBudget | None:
        """The think-block budget of requests that set none (--reasoning-budget)."""
        return self.cfg.reasoning_budget

    @property
    def max_state_size(self) -> int:
        """The largest state one slot of the live model and context can hold (bytes)."""
        return self.kv_cache.max_state_size if self.kv_cache is not None else 0

    @property
    def state_chunk_size(self) -> int:
        """Bytes per write of a state transfer (T1 ``state_chunk_size``)."""
        return int(self.t1["state_chunk_size"])

    @property
    def default_n_predict(self) -> int:
        """Tokens to generate when a request sets no limit: T1 ``n_predict``, else a slot's context."""
        n = int(self.t1.get("n_predict", -1))
        return n if n >= 0 else self.n_ctx_slot

    @property
    def queued_unassigned(self) -> int:
        return len(self.scheduler.unassigned)

    def snapshot(self, slot: int) -> SlotSnapshot:
        return self.snapshots[slot]

    def info(self) -> EngineInfo:
        now = time.monotonic()
        return EngineInfo(
            startup_stage=self.startup_stage, expert_mode=self.expert_mode, config_generation=self.generation,
            reload=self.reload, reload_policy=self.cfg.reload_policy, reload_mode=self.cfg.reload_mode,
            slots_total=self.n_slots,
            slots_busy=sum(1 for s in self.snapshots if s.is_processing or s.is_transferring),
            n_ctx_slot=self.n_ctx_slot, rpc_servers=self.params.rpc_servers,
            devices=tuple(self.cfg.backend.devices(self.params)), aliases=self.aliases, identity=self.identity,
            slot_states=tuple(s.state for s in self.snapshots),
            steps_per_s=rate(self._step_rate.frozen(), self.stats["steps"], now),
            tokens_per_s=rate(self._token_rate.frozen(), self.stats["tokens_generated"], now),
            params=self.params, kv_cache=self.kv_cache, prompt_cache=self.cache.info(),
            priorities=tuple(self.priorities.items()),
            tensor_overrides=tuple(getattr(self.model, "tensor_overrides", ())),
            backend_devices=tuple(self._backend_devices()), gpu_offload=self._gpu_offload())

    def _backend_devices(self) -> list[dict[str, Any]]:
        listing = getattr(self.cfg.backend, "backend_devices", None)
        return listing() if listing is not None else [{"name": d, "description": "", "type": d, "backend": d}
                                                      for d in self.cfg.backend.devices(self.params)]

    def _gpu_offload(self) -> dict[str, Any] | None:
        offload = getattr(self.model, "gpu_offload", None)
        return offload.as_dict() if offload is not None else None

    @property
    def aliases(self) -> tuple[str, ...]:
        """The model aliases clients may name (PREFILL ``model``, SWAP_QUANT), sorted."""
        return tuple(sorted(self.cfg.aliases))

    def model_states(self) -> dict[str, str]:
        """Configured model aliases (sorted) → ``loaded`` (the resident file), ``loading`` (the
        pending reload's target), ``failed`` (the latest reload's target, which failed) or
        ``unloaded``."""
        r = self.reload
        out = {}
        for alias, spec in sorted(self.cfg.aliases.items()):
            path = resolve_path(self.cfg.resolve_model, spec)
            if path == self.params.model_path:
                out[alias] = "loaded"
            elif path == r.target and (r.pending or r.state is ReloadState.FAILED):
                out[alias] = "loading" if r.pending else "failed"
            else:
                out[alias] = "unloaded"
        return out

    # ------------------------------------------------------------------ requests
    def sampling_for(self, fields: Mapping[str, Any] | None = None) -> SamplerParams:
        """T1 defaults, then the request's own sampling fields (any dialect's spelling)."""
        return merge_sampling(self.t1, fields)

    def set_expert_mode(self, mode: str) -> str:
        """Returns the mode in effect: always "solo" (no combined head or peer exists here)."""
        self.expert_mode = "solo"
        return self.expert_mode

    def submit(self, job: GenJob) -> GenJob:
        """Queue a generation job. Raises EngineBusy / EngineUnavailable / BadInput at once when refused."""
        if self.model is None and self.startup_stage != "ready":
            raise EngineUnavailable(f"no model loaded (stage {self.startup_stage})")
        if job.slot is None:
            if job.append or (job.messages is None and job.prompt is None and job.tokens is None):
                raise BadInput("a request that names no slot needs a prompt (and cannot continue a slot)")
        elif not 0 <= job.slot < self.n_slots:
            raise BadInput(f"invalid slot {job.slot}")
        if self.reloader.pending and self.cfg.reload_policy == "reject":
            raise EngineBusy("reloading", retry_after_ms=self._retry_after_ms())
        self._require_actor()
        job.done = asyncio.get_running_loop().create_future()
        job.wake = self._wake
        self.post(Submit(job))
        return job

    async def submit_admitted(self, job: GenJob) -> GenJob:
        """``submit``, then wait until the actor has taken the job (running, or queued while a
        reload drains): a refusal (EngineBusy for a busy slot and ``job.wait`` False) is raised
        here instead of failing ``job.result()`` later."""
        self.submit(job)
        await self._call(Wake())  # the mailbox is FIFO: the Submit before it has been handled
        if job.done.done() and not job.done.cancelled() and job.done.exception() is not None:
            raise job.done.exception()
        return job

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

    async def wait_reload(self, ticket: ReloadTicket) -> int:
        """Wait until a configure's reload is live; returns its generation. Raises ReloadFailed."""
        return await wait_live(ticket)

    async def swap_model(self, alias: str) -> ConfigureOutcome:
        """SWAP_QUANT: reload to a configured alias (not awaited). KeyError for an unknown alias."""
        return await self.configure({"model_path": self.cfg.aliases[alias]})

    async def select_model(self, alias: str | None, hydra_config: Mapping[str, Any] | None = None) -> ModelChoice:
        """Settle a request's ``model`` (an alias) and ``hydra_config`` before it runs.

        A configured alias of another file, or staged keys, reload the model and wait until the
        new one is live; the returned ``params`` pins the request to it (``GenJob.params``), so
        it is served by exactly that config or fails. Any other name is served by the resident
        model, as llama-server does. Raises ReloadFailed (the reload did not happen).
        """
        path = self.cfg.aliases.get(alias) if alias else None
        name = alias if path is not None else self.identity.display_name
        fallback = bool(alias) and path is None and alias not in (self.identity.model_name,
                                                                  self.identity.model_alias)
        if path is None and hydra_config is None:
            return ModelChoice(name, fallback, 0.0, None)
        staged = dict(hydra_config or {})
        if path is not None:
            # Always staged: whether it is already live is the actor's to decide, atomically with
            # the other messages — judged here, a reload landing in between would pin the
            # request to the wrong model.
            staged["model_path"] = path
        out = await self.configure(staged)
        if out.reload_ticket is None:
            return ModelChoice(name, fallback, 0.0, out.params)
        await self.wait_reload(out.reload_ticket)
        return ModelChoice(name, fallback, out.reload_ticket.load_ms, out.params)

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
        while not self._stopping:
            while True:
                try:
                    item = self._mailbox.get_nowait()
                except asyncio.QueueEmpty:
                    break
                await self._handle(*item)
                del item  # its future may hold a multi-MiB state: do not keep it until the next one
            self.scheduler.reap_cancelled(self._serving())
            if self.erases.held():
                await self._erase_deferred()
            await self.reloader.maybe_swap()
            running = self.scheduler.active()
            if not running:
                self._publish()
                item = await self._mailbox.get()
                await self._handle(*item)
                del item
                continue
            threads = self._threads_for_step()
            try:
                await self._infer.call(self._step, running, threads)
            except Exception as e:  # a failed batched decode fails the jobs in it
                log.error("decode step failed: %s", e)
                for r in running:
                    r.error = r.error or e
            self.stats["steps"] += 1
            self.scheduler.after_step(running, self._serving())
            now = time.monotonic()
            self._step_rate.record(self.stats["steps"], now)
            self._token_rate.record(self.stats["tokens_generated"], now)
            self._publish()
            # One turn of the loop for what the step woke (the streams' writers) before the next
            # step starts: done now, while the compute threads wait anyway, their sends do not
            # preempt a compute thread mid-graph — on a host whose cores all compute, that costs
            # twice (its partner spins at the next barrier). +6–13 % tok/s (docs/performance.md).
            await asyncio.sleep(0)
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

    def _step(self, running: list[Running], threads: int | None = None) -> None:
        if threads is not None:
            self.model.set_threads(threads)
        # llama.cpp caps n_batch at n_ctx; a batch must never exceed what the context accepts
        budget = min(self.cfg.token_budget, self.model.n_batch)
        # --context-shift: llama-server keeps n_keep tokens and the BOS (and turns the shift off
        # for a KV cache that cannot move positions, e.g. a sliding window)
        shift = self.params.context_shift and self.model.can_shift
        keep = int(self.t1.get("n_keep", 0)) + 1 if shift else None
        run_step(self.model, running, n_ctx_slot=self.n_ctx_slot, token_budget=budget, shift_keep=keep,
                 time_slice=self.cfg.time_slice, cache=self.cache, counters=self.stats)

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
            try:  # the slot is chosen by the prompt's tokens: tokenize now, on the inference thread
                job.tokenized = (model, await asyncio.get_running_loop().run_in_executor(
                    self._infer, job_input, model, job, False))
            except Exception as e:
                fail(job, e)
                return
        self.scheduler.offer(job, self._serving())
        self._publish()

    # ------------------------------------------------------------------ state transfer
    def _require_idle(self, slot_id: int, what: str = "busy") -> Slot:
        if self.model is None:  # an in-place reload freed it and is loading the next one
            raise EngineBusy("no model loaded: an in-place reload is in progress", self._retry_after_ms())
        slot = self.slots[slot_id]
        if slot.busy:
            raise EngineBusy(f"slot {slot_id} is {what}")
        return slot

    async def _on_state_get(self, msg: StateGet) -> StateOut:
        slot = self._require_idle(msg.slot)
        slot.transferring = True
        slot.begin("state_get", slot.n_past)
        self._publish()
        loop = asyncio.get_running_loop()
        model = self.model
        release = None
        try:
            size = await loop.run_in_executor(self._infer, model.state_seq_size, slot.id)
            buf, release = self._state_buf.lease(size)
            n = await loop.run_in_executor(self._infer, model.state_seq_get_into, slot.id, buf)
        except BaseException:
            if release is not None:
                release()
            raise
        finally:
            slot.transferring = False
            slot.operation = "idle"
        slot.state_size = n
        self._publish()
        return StateOut(slot.n_past, list(slot.tokens), buf[:n].toreadonly(), self.identity,
                        slot.generation, release)

    async def _on_state_put(self, msg: StatePut) -> int:
        slot = self._require_idle(msg.slot)
        slot.transferring = True
        slot.begin("state_put", len(msg.tokens))
        self._publish()
        model = self.model

        def load() -> tuple[int, int, int]:
            n = restore_state(model, slot.id, msg.state, msg.declared)  # every claim is checked first
            return n, model.seq_pos_max(slot.id), model.state_seq_size(slot.id)

        try:
            n, pos_max, size = await asyncio.get_running_loop().run_in_executor(self._infer, load)
        except (CodecError, KvStateMismatch, BadDeclaration):
            raise  # refused before anything changed: the slot keeps what it held
        except Exception:
            slot.tokens, slot.tail = [], []
            raise
        finally:
            slot.transferring = False
            slot.operation = "idle"
        n_kv = pos_max + 1
        # Positions whose token we do not know get -1: they never match a prompt, so prefix
        # reuse stops there, and a continuation cannot re-feed an unknown token.
        slot.tokens = (list(msg.tokens[:n_kv]) + [-1] * max(0, n_kv - len(msg.tokens)))
        slot.tail = []
        self.cache.checkpoints.forget(slot.id)  # they belong to the state just replaced
        slot.state_size = size
        slot.generation = self.generation
        self.scheduler.touch(slot)
        self._publish()
        return n

    async def _on_erase(self, msg: Erase) -> int | asyncio.Future:
        slot = self.slots[msg.slot]
        if self.model is not None and (slot.busy or slot.erase_waiters):
            return self.erases.add(slot)  # the caller awaits it; done by _erase_deferred
        return await self._erase_now(self._require_idle(msg.slot, "processing"))

    async def _erase_now(self, slot: Slot) -> int:
        n = slot.n_past
        await asyncio.get_running_loop().run_in_executor(self._infer, self.model.seq_clear, slot.id)
        slot.tokens, slot.tail, slot.state_size = [], [], 0
        self.cache.checkpoints.forget(slot.id)
        self._publish()
        return n

    async def _erase_deferred(self) -> None:
        """Erase the slots freed since an erase was deferred, then admit what they held back."""
        for slot in self.erases.due():
            if self.model is None:
                continue  # an in-place reload is building: the slots are empty once it is done
            try:
                self.erases.answer(slot, await self._erase_now(slot))
            except Exception as e:
                self.erases.answer(slot, 0, e)
        self.scheduler.admit_queued(self._serving())
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
                slot.tokens, slot.tail, slot.state_size = [], [], 0
        self._publish()
        return old

    def admit_queued(self) -> None:
        self.scheduler.admit_queued(self._serving())

    def lost_model(self, error: str) -> None:
        self.startup_stage, self.startup_error = "failed", error
        self.scheduler.stop_all(EngineUnavailable(error), self._serving())
