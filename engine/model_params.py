"""What a model is built from (``ModelParams``), and how a staged CONFIGURE derives new ones."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from .rpc_allow import rpc_server_list
from .tiers import T4_CTX_PARAMS, T4_MODEL_PARAMS, model_path_of

CACHE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


@dataclass(frozen=True)
class ModelParams:
    """Everything a backend factory needs to build a model; a staged CONFIGURE derives a new one.

    Frozen and compared by value: a reload is needed exactly when the derived params differ.
    """

    model_path: str
    n_ctx_slot: int = 4096
    n_slots: int = 4
    n_batch: int = 512
    n_threads: int | None = None
    n_gpu_layers: int = 0
    rpc_servers: tuple[str, ...] = ()
    ctx_params: tuple[tuple[str, Any], ...] = ()
    model_params: tuple[tuple[str, Any], ...] = ()

    def derive(self, staged: dict[str, Any], resolve_model: Callable[[str], Any]) -> "ModelParams":
        """Apply staged T2/T3/T4 keys. Raises ValueError for values of the wrong type."""
        p = self
        ctx = dict(self.ctx_params)
        mp = dict(self.model_params)
        path = model_path_of(staged)
        if path is not None:
            p = replace(p, model_path=resolve_path(resolve_model, path))
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
                servers = rpc_server_list(v)
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


def resolve_path(resolve_model: Callable[[str], Any], spec: str) -> str:
    """A model name or path → the file to load. A name that does not resolve is kept as it is:
    the build then fails and the reload reports it (a failed reload, not a refused request)."""
    try:
        return str(resolve_model(spec))
    except (OSError, ValueError):
        return spec
