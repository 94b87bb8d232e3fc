"""Model parameters, building a (shadow) model off the event loop, and reload bookkeeping."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from .llama_backend import LoadedModel
from .tiers import T4_CTX_PARAMS, T4_MODEL_PARAMS, model_path_of

CACHE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


@dataclass(frozen=True)
class ModelParams:
    """Everything needed to build a LoadedModel; a staged CONFIGURE derives a new one."""

    model_path: str
    n_ctx_slot: int = 4096
    n_slots: int = 4
    n_batch: int = 512
    n_threads: int | None = None
    n_gpu_layers: int = 0
    rpc_servers: tuple[str, ...] = ()
    ctx_params: tuple[tuple[str, Any], ...] = ()
    model_params: tuple[tuple[str, Any], ...] = ()

    def derive(self, staged: dict[str, Any], resolve_model) -> "ModelParams":
        """Apply staged T2/T3/T4 keys. Raises ValueError for values of the wrong type."""
        p = self
        ctx = dict(self.ctx_params)
        mp = dict(self.model_params)
        path = model_path_of(staged)
        if path is not None:
            try:
                path = str(resolve_model(path))
            except (OSError, ValueError):
                pass  # reported by the (failing) build, as a failed reload — not here
            p = replace(p, model_path=path)
        for key, v in staged.items():
            if key == "n_ctx":
                if not isinstance(v, int) or isinstance(v, bool) or v < 16:
                    raise ValueError("n_ctx must be an integer ≥ 16")
                p = replace(p, n_ctx_slot=v)
            elif key in ("cache_type_k", "cache_type_v"):
                if v not in CACHE_TYPES:
                    raise ValueError(f"{key} must be one of {sorted(CACHE_TYPES)}")
                ctx["type_k" if key.endswith("k") else "type_v"] = CACHE_TYPES[v]
            elif key.startswith("rope_"):
                field_name = {"rope_freq_base": "rope_freq_base", "rope_freq_scale": "rope_freq_scale",
                              "rope_scale": "rope_freq_scale"}.get(key)
                if field_name is None:
                    continue  # rope_scaling (a type name) etc.: accepted, no equivalent
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    raise ValueError(f"{key} must be a number")
                ctx[field_name] = float(v) if key != "rope_scale" else 1.0 / float(v)
            elif key == "n_gpu_layers":
                if not isinstance(v, int) or isinstance(v, bool):
                    raise ValueError("n_gpu_layers must be an integer")
                p = replace(p, n_gpu_layers=v)
            elif key == "rpc_servers":
                servers = v.split(",") if isinstance(v, str) else v
                if not isinstance(servers, list) or not all(isinstance(s, str) for s in servers):
                    raise ValueError("rpc_servers must be a string 'host:port,...' or a list of them")
                servers = tuple(s.strip() for s in servers if s.strip())
                p = replace(p, rpc_servers=servers, n_gpu_layers=p.n_gpu_layers or (999 if servers else 0))
            elif key in T4_CTX_PARAMS:
                ctx[T4_CTX_PARAMS[key]] = v
            elif key in T4_MODEL_PARAMS:
                if not isinstance(v, bool):
                    raise ValueError(f"{key} must be true or false")
                # LLAMA_LOAD_MODE_*: bit 0 = mmap, bit 1 = mlock; AUTO (-1) counts as mmap
                mode = mp.get("load_mode", 1)
                mode = 1 if mode < 0 else mode
                bit = 1 if key == "use_mmap" else 2
                mp["load_mode"] = (mode | bit) if v else (mode & ~bit)
        return replace(p, ctx_params=tuple(sorted(ctx.items())), model_params=tuple(sorted(mp.items())))


def build_model(p: ModelParams) -> LoadedModel:
    """Load weights and create the context (loader thread; blocking)."""
    if p.rpc_servers:
        from .ggml_rpc_lib import register_rpc_server

        for ep in p.rpc_servers:
            register_rpc_server(ep)
    return LoadedModel(p.model_path, n_ctx=p.n_ctx_slot * p.n_slots, n_seq_max=p.n_slots, n_batch=p.n_batch,
                       n_threads=p.n_threads, n_gpu_layers=p.n_gpu_layers,
                       extra_model_params=dict(p.model_params) or None,
                       extra_ctx_params=dict(p.ctx_params) or None)


@dataclass
class ReloadInfo:
    """What INFO reports under ``reload`` (the C++ reports nothing)."""

    state: str = "idle"  # idle | loading | draining | swapped | failed | dropped
    generation: int = 0  # the config generation the reload will produce
    target: str = ""
    tier: str = ""
    error: str = ""
    started_at: float = 0.0
    load_ms: float = 0.0
    swap_ms: float = 0.0
    keys: list[str] = field(default_factory=list)

    @property
    def pending(self) -> bool:
        return self.state in ("loading", "draining")

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "generation": self.generation, "target": self.target, "tier": self.tier,
                "error": self.error, "started_at": self.started_at, "load_ms": round(self.load_ms, 3),
                "swap_ms": round(self.swap_ms, 3), "keys": list(self.keys),
                "pending_for_ms": round((time.time() - self.started_at) * 1000, 1) if self.pending else 0}
