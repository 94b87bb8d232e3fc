"""The engine as the wire layers see it: requests in, handles and snapshots out.

``EngineApi`` is the only engine object ``hydra_rpc`` holds. Behind it one actor task
(``engine.actor``) owns the model, the context and the slots; the facade reads what the actor
publishes (immutable snapshots, counters) without entering its mailbox, and turns every other
call into a mailbox message. The values it takes and returns are defined in ``engine.jobs``
(``GenRequest``, ``JobHandle``, the refusals) and ``engine.status`` (identity, INFO, reload
state); see docs/architecture.md, "The engine's facade".
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping

from .chat.formats import ChatFormat, detect_format
from .config import EngineConfig, StateOut
from .jobs import GenRequest, JobHandle
from .kv_cache import KvCacheInfo
from .model_params import ModelParams, resolve_path

from .rates import rate
from .reasoning_budget import ReasoningBudget
from .reloader import ReloadTicket, wait_live
from .sampling import GrammarSpec, SamplerParams, merge_sampling
from .slots import SlotSnapshot
from .status import (ComputeThreadsInfo, ConfigureOutcome, EngineInfo, ModelChoice, ModelIdentity, PromptCacheInfo,
                     ReloadState, ReloadStatus)


class EngineApi:
    def __init__(self, cfg: EngineConfig):
        from .actor import EngineActor

        self._cfg = cfg
        self._actor = EngineActor(cfg)

    @property
    def actor(self) -> Any:
        """The actor behind the facade: for white-box tests and the benchmarks, never the wire."""
        return self._actor

    # ------------------------------------------------------------------ lifecycle
    def check(self) -> None:
        """Raise RuntimeError when the backend cannot run here (before anything is served)."""
        self._actor.check()

    async def start(self) -> None:
        """Load the first model (off-loop) and start the actor task."""
        await self._actor.start()

    async def stop(self, timeout: float = 10.0) -> None:
        """Cancel queued and running work, stop the actor, free models off-loop."""
        await self._actor.stop(timeout)

    # ------------------------------------------------------------------ reads (no mailbox)
    @property
    def ready(self) -> bool:
        """A model is loaded and serving (not during an in-place reload's load)."""
        return self._actor.ready

    @property
    def startup_stage(self) -> str:
        """init | loading_model | ready | failed"""
        return self._actor.startup_stage

    @property
    def startup_error(self) -> str:
        return self._actor.startup_error

    @property
    def generation(self) -> int:
        """The config generation new work is served with."""
        return self._actor.generation

    @property
    def identity(self) -> ModelIdentity:
        return self._actor.identity

    @property
    def params(self) -> ModelParams:
        """The live model config (the start-up one until a reload lands)."""
        return self._actor.params

    @property
    def kv_cache(self) -> KvCacheInfo | None:
        """The live model's KV cache: what a restored state must match."""
        return self._actor.kv_cache

    @property
    def reload(self) -> ReloadStatus:
        return self._actor.reload

    @property
    def stats(self) -> Mapping[str, Any]:
        """Counters since start (tokens, steps, jobs, llama-server's /metrics counters)."""
        return self._actor.stats

    @property
    def snapshots(self) -> tuple[SlotSnapshot, ...]:
        """Every slot as of the last step (published by the actor; never stale by more than one step)."""
        return self._actor.snapshots

    def snapshot(self, slot: int) -> SlotSnapshot:
        return self._actor.snapshots[slot]

    @property
    def n_slots(self) -> int:
        return self._actor.n_slots

    @property
    def n_ctx_slot(self) -> int:
        """Tokens one slot may hold (llama-server's rule; 0 before the first model)."""
        return self._actor.n_ctx_slot

    @property
    def n_vocab(self) -> int:
        return self._actor.identity.n_vocab

    @property
    def max_state_size(self) -> int:
        """The largest state one slot of the live model and context can hold (bytes)."""
        kv = self._actor.kv_cache
        return kv.max_state_size if kv is not None else 0

    @property
    def state_chunk_size(self) -> int:
        """Bytes per write of a state transfer (T1 ``state_chunk_size``)."""
        return int(self._actor.t1["state_chunk_size"])

    @property
    def default_n_predict(self) -> int:
        """Tokens to generate when a request sets no limit: T1 ``n_predict``, else a slot's context."""
        n = int(self._actor.t1.get("n_predict", -1))
        return n if n >= 0 else self.n_ctx_slot

    @property
    def queued_unassigned(self) -> int:
        """Requests naming no slot, waiting for any."""
        return len(self._actor.scheduler.unassigned)

    @property
    def erases_waiting(self) -> int:
        """ERASEs deferred until their slot's job or transfer ends."""
        return sum(len(s.erase_waiters) for s in self._actor.slots)

    @property
    def chat_syntax(self) -> ChatFormat:
        """The live model's chat template format (tool calls, reasoning); generic before a model."""
        model = self._actor.model
        return model.chat_syntax if model is not None else detect_format(None)

    @property
    def reasoning_format(self) -> str:
        """How chat answers split ``<think>`` blocks unless a request says (--reasoning-format)."""
        return self._cfg.reasoning_format

    @property
    def default_grammar(self) -> GrammarSpec | None:
        """The grammar of requests that bring none (--grammar, --json-schema)."""
        return self._cfg.default_grammar

    @property
    def reasoning_budget(self) -> ReasoningBudget | None:
        """The think-block budget of requests that set none (--reasoning-budget)."""
        return self._cfg.reasoning_budget

    @property
    def slot_save_path(self) -> str:
        """Where ``POST /slots/{id}?action=save|restore`` files live ("" : the endpoint is off)."""
        return self._cfg.slot_save_path

    @property
    def aliases(self) -> tuple[str, ...]:
        """The model aliases clients may name (PREFILL ``model``, SWAP_QUANT), sorted."""
        return tuple(sorted(self._cfg.aliases))

    @property
    def n_keep(self) -> int:
        """Tokens a context shift keeps after the BOS (T1 ``n_keep``)."""
        return int(self._actor.t1.get("n_keep", 0))

    def prompt_cache_info(self) -> PromptCacheInfo:
        return self._actor.cache.info()

    def compute_threads_info(self) -> ComputeThreadsInfo:
        """The compute threads a step uses and why (engine.compute_threads); zeros before a model."""
        ct = self._actor.compute_threads
        return ct.info() if ct is not None else ComputeThreadsInfo()

    def checkpoints_of(self, slot: int) -> list[dict[str, int]]:
        """``/slots``: the slot's context checkpoints (engine.checkpoints), oldest first."""
        return self._actor.cache.checkpoints.of_slot(slot)

    def model_states(self) -> dict[str, str]:
        """Configured model aliases (sorted) → ``loaded`` (the resident file), ``loading`` (the
        pending reload's target), ``failed`` (the latest reload's target, which failed) or
        ``unloaded``."""
        r, live = self.reload, self._actor.params.model_path
        out = {}
        for alias, spec in sorted(self._cfg.aliases.items()):
            path = resolve_path(self._cfg.resolve_model, spec)
            if path == live:
                out[alias] = "loaded"
            elif path == r.target and (r.pending or r.state is ReloadState.FAILED):
                out[alias] = "loading" if r.pending else "failed"
            else:
                out[alias] = "unloaded"
        return out

    def info(self) -> EngineInfo:
        a, now = self._actor, time.monotonic()
        return EngineInfo(
            startup_stage=a.startup_stage, expert_mode=a.expert_mode, config_generation=a.generation,
            reload=a.reload, reload_policy=self._cfg.reload_policy, reload_mode=self._cfg.reload_mode,
            slots_total=a.n_slots,
            slots_busy=sum(1 for s in a.snapshots if s.is_processing or s.is_transferring),
            n_ctx_slot=a.n_ctx_slot, rpc_servers=a.params.rpc_servers,
            devices=tuple(self._cfg.backend.devices(a.params)), aliases=self.aliases, identity=a.identity,
            slot_states=tuple(s.state for s in a.snapshots),
            steps_per_s=rate(a.step_rate.frozen(), a.stats["steps"], now),
            tokens_per_s=rate(a.token_rate.frozen(), a.stats["tokens_generated"], now),
            params=a.params, kv_cache=a.kv_cache, prompt_cache=a.cache.info(),
            priorities=tuple(a.priorities.items()),
            tensor_overrides=tuple(getattr(a.model, "tensor_overrides", ())),
            backend_devices=tuple(self._backend_devices()), gpu_offload=self._gpu_offload())

    def _backend_devices(self) -> list[dict[str, Any]]:
        backend, params = self._cfg.backend, self._actor.params
        listing = getattr(backend, "backend_devices", None)
        return listing() if listing is not None else [{"name": d, "description": "", "type": d, "backend": d}
                                                      for d in backend.devices(params)]

    def _gpu_offload(self) -> dict[str, Any] | None:
        offload = getattr(self._actor.model, "gpu_offload", None)
        return offload.as_dict() if offload is not None else None

    # ------------------------------------------------------------------ requests
    def sampling_for(self, fields: Mapping[str, Any] | None = None, **given: Any) -> SamplerParams:
        """T1 defaults, then the request's own sampling fields (any dialect's spelling), then
        ``given`` SamplerParams attributes (a grammar, a logit bias)."""
        return merge_sampling(self._actor.t1, fields, **given)

    def set_expert_mode(self, mode: str) -> str:
        """Returns the mode in effect: always "solo" (no combined head or peer exists here)."""
        self._actor.expert_mode = "solo"
        return self._actor.expert_mode

    def submit(self, request: GenRequest) -> JobHandle:
        """Queue a generation. Raises EngineBusy / EngineUnavailable / BadInput at once when
        refused; later refusals fail ``handle.result()``."""
        return self._actor.submit(request)

    async def submit_admitted(self, request: GenRequest) -> JobHandle:
        """``submit``, then wait until the actor has taken the job (running, or queued while a
        reload drains): a refusal (EngineBusy for a busy slot and ``request.wait`` False) is
        raised here instead of failing ``handle.result()`` later."""
        return await self._actor.submit_admitted(request)

    async def state_get(self, slot: int) -> StateOut:
        return await self._actor.state_get(slot)

    async def state_put(self, slot: int, tokens: list[int], state: bytes | bytearray | memoryview,
                        declared: Any = None) -> int:
        """Restore ``state`` into ``slot``. ``declared``: the sender's ``kv_cache`` (rotation,
        RoPE: what the bytes mean beyond llama.cpp's header), compared before anything changes."""
        return await self._actor.state_put(slot, tokens, state, declared)

    async def erase(self, slot: int) -> int:
        """Clear the slot's sequence; returns the tokens erased. A busy slot is erased when
        its job or transfer ends (engine/erase.py), EngineBusy past the bound."""
        return await self._actor.erase(slot)

    async def with_model(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(model)`` on the inference thread, between steps (llama-server's /tokenize,
        /detokenize, /apply-template). EngineBusy while an in-place reload has no model."""
        return await self._actor.with_model(fn)

    async def configure(self, cfg: Mapping[str, Any]) -> ConfigureOutcome:
        """Classify and apply a CONFIGURE: T1 at once, staged tiers start (or join) a reload.

        Values of the wrong type or out of range are ``rejected_keys``: nothing refuses the whole
        request.
        """
        return await self._actor.configure(cfg)

    async def wait_reload(self, ticket: ReloadTicket) -> int:
        """Wait until a configure's reload is live; returns its generation. Raises ReloadFailed."""
        return await wait_live(ticket)

    async def swap_model(self, alias: str) -> ConfigureOutcome:
        """SWAP_QUANT: reload to a configured alias (not awaited). KeyError for an unknown alias."""
        return await self.configure({"model_path": self._cfg.aliases[alias]})

    async def select_model(self, alias: str | None, hydra_config: Mapping[str, Any] | None = None) -> ModelChoice:
        """Settle a request's ``model`` (an alias) and ``hydra_config`` before it runs.

        A configured alias of another file, or staged keys, reload the model and wait until the
        new one is live; the returned ``params`` pins the request to it (``GenRequest.params``),
        so it is served by exactly that config or fails. Any other name is served by the resident
        model, as llama-server does. Raises ReloadFailed (the reload did not happen).
        """
        path = self._cfg.aliases.get(alias) if alias else None
        ident = self.identity
        name = alias if path is not None else ident.display_name
        fallback = bool(alias) and path is None and alias not in (ident.model_name, ident.model_alias)
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
