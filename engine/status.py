"""Typed data the engine hands to the wire layer, which shapes it into JSON (``hydra_rpc``).

Everything here is immutable: a reader (INFO, STATE_META, ``/slots``, metrics) may hold
it while the actor moves on.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from .model_params import ModelParams


def flat_fields(obj: Any) -> dict[str, Any]:
    """A dataclass of plain values as a dict: ``dataclasses.asdict`` without its deep copy, which
    showed in INFO's per-request cost (identities and counters hold no containers)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


@dataclass(frozen=True)
class ModelIdentity:
    """The resident model as the wire names it (empty before the first load)."""

    model_path: str = ""
    model_name: str = ""
    tokenizer: str = ""
    model_quant: str = ""
    model_capabilities: int = 0
    model_alias: str = ""
    model_hash: str = ""  # SHA-256 of the model file (engine.model_hash); "" when unknown
    n_vocab: int = 0

    @classmethod
    def of(cls, backend_identity: dict[str, Any], n_vocab: int) -> "ModelIdentity":
        ident = backend_identity
        return cls(model_path=str(ident.get("model_path", "")), model_name=str(ident.get("model_name", "")),
                   tokenizer=str(ident.get("tokenizer", "")), model_quant=str(ident.get("model_quant", "")),
                   model_capabilities=int(ident.get("model_capabilities", 0)),
                   model_alias=str(ident.get("model_name", "")), model_hash=str(ident.get("model_hash") or ""),
                   n_vocab=n_vocab)

    @property
    def display_name(self) -> str:
        """The name to report for the resident model."""
        return self.model_alias or self.model_name or "hydra-rpc"


class ReloadState(str, enum.Enum):
    """Where the latest reload is. ``loading``/``draining`` are pending; the rest are final.

    shadow:   loading (build beside the live model) → draining (built; wait for in-flight
              work) → swapped.
    in-place: draining (wait for in-flight work) → loading (old model freed) → swapped.
    Either may end ``failed`` (the build failed; the old config still serves) or ``dropped``
    (the drain timeout passed, or a newer config replaced it).
    """

    IDLE = "idle"
    LOADING = "loading"
    DRAINING = "draining"
    SWAPPED = "swapped"
    FAILED = "failed"
    DROPPED = "dropped"

    @property
    def pending(self) -> bool:
        return self in (ReloadState.LOADING, ReloadState.DRAINING)


@dataclass(frozen=True)
class ReloadStatus:
    """The latest reload (the C++ reports nothing about reloads)."""

    state: ReloadState = ReloadState.IDLE
    generation: int = 0  # the config generation it will produce (or produced, once swapped)
    target: str = ""
    tier: str = ""
    error: str = ""
    started_at: float = 0.0  # wall-clock seconds, for reporting
    load_ms: float = 0.0
    swap_ms: float = 0.0
    keys: tuple[str, ...] = ()
    progress: float = 0.0  # share of the target's tensor bytes loaded (llama.cpp's progress callback)
    model_bytes: int = 0  # size of the target file

    @property
    def load_stage(self) -> str:
        """tensors (reading and repacking weights), context (creating the KV cache), or done."""
        if self.state is not ReloadState.LOADING:
            return "done" if self.load_ms else ""
        return "context" if self.progress >= 1.0 else "tensors"

    @property
    def pending(self) -> bool:
        return self.state.pending


@dataclass(frozen=True)
class ComputeThreadsInfo:
    """What the step's thread count followed (engine.compute_threads; /metrics): the configured
    count and the one the last step used, the cores other processes used in the last sample, how
    often the count went down and the seconds of work stepped below the configured count."""

    configured: int = 0
    current: int = 0
    others_cores: float = 0.0
    lowered: int = 0
    reduced_seconds: float = 0.0


@dataclass(frozen=True)
class PromptCacheInfo:
    """The prompt cache's settings and counters since start (INFO ``prompt_cache``, /metrics)."""

    cache_prompt: bool = True
    cache_reuse: int = 0
    lookups: int = 0  # prompts lined up with a slot's KV
    hits: int = 0  # … that reused at least one cached token
    tokens_saved: int = 0  # prompt tokens reused instead of computed
    from_own: int = 0  # hits by source: the slot's own KV, another slot's, the RAM tier
    from_shared: int = 0
    from_host: int = 0
    from_checkpoint: int = 0  # … a context checkpoint of the slot
    chunks_shifted: int = 0  # cache_reuse chunks moved into place
    cache_reuse_refused: str = ""  # why cache_reuse does nothing on this model (cannot shift)
    cut_refused: int = 0  # prompts whose common prefix with their slot was recomputed: the memory
    tokens_recomputed: int = 0  # could not be cut back to it (recurrent, window) and no checkpoint served
    ctx_checkpoints: int = 0  # context checkpoints: the most kept per slot (--ctx-checkpoints)
    checkpoints: int = 0  # kept now, all slots
    checkpoints_bytes: int = 0
    checkpoints_created: int = 0
    checkpoints_restored: int = 0
    ram_limit_bytes: int = 0  # -1: no limit; 0: the RAM tier is off
    ram_entries: int = 0
    ram_bytes: int = 0
    ram_saves: int = 0
    ram_restores: int = 0
    ram_evictions: int = 0  # dropped to make room
    ram_invalidated: int = 0  # dropped because their model was replaced
    disk_entries: int = 0  # the disk tier under slot_save_path (RAM evictions spilled there)
    disk_bytes: int = 0
    disk_spills: int = 0
    disk_restores: int = 0  # of ram_restores, those read back from the disk tier


@dataclass(frozen=True)
class EngineInfo:
    """What INFO reports about the engine, read without entering the mailbox."""

    startup_stage: str
    expert_mode: str
    config_generation: int
    reload: ReloadStatus
    reload_policy: str
    reload_mode: str
    slots_total: int
    slots_busy: int
    n_ctx_slot: int
    rpc_servers: tuple[str, ...]
    devices: tuple[str, ...]
    aliases: tuple[str, ...]
    identity: ModelIdentity
    slot_states: tuple[str, ...]  # per slot: idle | prefill | decode | transfer
    steps_per_s: float  # engine-wide, over the last seconds (engine.rates)
    tokens_per_s: float
    params: ModelParams | None = None  # the live model's
    kv_cache: Any = None  # the live model's KvCacheInfo
    prompt_cache: PromptCacheInfo = field(default_factory=PromptCacheInfo)
    priorities: tuple[tuple[str, str], ...] = ()  # thread → scheduling (engine.executors.thread_policy)
    tensor_overrides: tuple[dict[str, Any], ...] = ()  # per -ot / MoE pattern: the tensors it moved
    backend_devices: tuple[dict[str, Any], ...] = ()  # ggml's registry: name, description, type, backend
    gpu_offload: dict[str, Any] | None = None  # engine.gpu.Offload.as_dict() of the live model


@dataclass(frozen=True)
class ConfigureOutcome:
    """What a CONFIGURE (or the config part of a PREFILL) did."""

    tier: str
    params_applied: dict[str, Any]
    deferred_keys: list[str]
    unrecognized_keys: list[str]
    rejected_keys: dict[str, str]
    config_generation: int  # live now, or promised by the pending reload
    params: ModelParams  # the model config this outcome leads to (live, or the reload's target)
    unchanged_keys: list[str] | None = None  # staged keys that asked for what is live already
    state_chunk_size_applied: int | None = None
    reload: ReloadState | None = None  # set when a reload is pending for this config
    reload_ticket: Any = field(default=None, compare=False, repr=False)  # for EngineApi.wait_reload


@dataclass(frozen=True)
class ModelChoice:
    """A request's ``model`` / ``hydra_config``, settled (see ``EngineApi.select_model``)."""

    name: str  # the name to report: the requested alias, else the resident model's
    fallback: bool  # the name is neither an alias nor the resident model (PREFILL model_fallback)
    load_ms: float  # how long the reload this request waited for spent loading (0: none)
    params: ModelParams | None  # the config the request must be served by (None: whatever is live)
