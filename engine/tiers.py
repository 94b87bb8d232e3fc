"""CONFIGURE key classification, shared by CONFIGURE and PREFILL ``hydra_config`` (docs/protocol.md).

Every value is typed and range-checked by engine/params_table.py first, so nothing llama.cpp
would assert on reaches it and a reload never fails because of a value's type:

T1  applied at once to the defaults of later requests (``sampling.temp`` … and the names a
    user would type, ``temp``, ``top_k``, ``repeat_penalty``, ``seed``, ``n_predict``).
T2  needs a new context (same weights): ``n_ctx``, cache types, ``rope_*``.
T3  needs a new model: ``model``/``model_path``, ``n_gpu_layers``, ``rpc_servers``, …
T4  any other model/context/chat parameter → reload.

A value of the wrong type or out of range, a key the C++ denies at runtime and a key that has
no effect here go to ``rejected_keys`` with the reason; unknown keys to ``unrecognized_keys``
(the C++ computes both and hides them). Nothing here fails the whole request.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from .params_table import ParamError, UnknownParam, lookup

if TYPE_CHECKING:
    from .kv_cache import KvCacheInfo
    from .model_params import ModelParams
    from .rpc_allow import RpcAllowList

STATE_CHUNK_MIN, STATE_CHUNK_MAX, STATE_CHUNK_DEFAULT = 64 * 1024, 64 * 1024 * 1024, 2 * 1024 * 1024
TIER_ORDER = {"T1": 1, "T2": 2, "T3": 3, "T4": 4}
DENIED = "denied: cannot change at runtime (as in the C++ engine)"
_DENIED_UNTYPED = {"fit", "fit_print", "fit_target", "fit_ctx"}  # llama.cpp's --fit*: device memory fitting
_SPEC = "speculative decoding is not implemented"
#: keys the C++ applies that change nothing here, with the reason (the same as docs/llama-args.md)
NO_EFFECT = {
    "split_mode": "device option: the installed llama.cpp build has no GPU backend (it runs on the CPU and on "
                  "ggml-RPC servers); applied with a GPU build (README, GPU nodes)",
    "tensor_split": "device option: the installed llama.cpp build has no GPU backend (it runs on the CPU and on "
                    "ggml-RPC servers); applied with a GPU build (README, GPU nodes)",
    "cont_batching": "always on: slots are decoded together in cooperative steps",
    "yarn_orig_ctx": "llama-engine discards it; applying it would make this engine's KV differ from the fleet's",
    "spec_type": _SPEC, "spec_draft_ngl": _SPEC, "spec_draft_n_max": _SPEC, "spec_draft_p_min": _SPEC,
}
#: NO_EFFECT keys that a build with a GPU backend applies (T3: a reload)
GPU_KEYS = frozenset({"split_mode", "tensor_split"})


def _gpu_backend() -> bool:
    from .gpu import gpu_backend

    return gpu_backend()


@dataclass
class Classified:
    t1: dict[str, Any] = field(default_factory=dict)  # canonical (dotted) names → values
    staged: dict[str, Any] = field(default_factory=dict)  # canonical T2/T3/T4 keys → typed values
    tier: str = "T1"
    deferred_keys: list[str] = field(default_factory=list)  # as sent
    rejected_keys: dict[str, str] = field(default_factory=dict)  # as sent → reason
    unrecognized_keys: list[str] = field(default_factory=list)

    def bump(self, tier: str) -> None:
        if TIER_ORDER[tier] > TIER_ORDER[self.tier]:
            self.tier = tier

    def reject(self, key: str, reason: str) -> None:
        """Take a staged key back (it will not be applied), saying why."""
        self.staged.pop(key, None)
        self.deferred_keys = [k for k in self.deferred_keys if lookup(k).key != key]
        self.rejected_keys[key] = reason
        self.tier = max(("T1", *(lookup(k).tier for k in self.staged)), key=TIER_ORDER.__getitem__)


def _flatten(cfg: dict[str, Any], out: Classified) -> list[tuple[str, Any]]:
    flat: list[tuple[str, Any]] = []
    for key, v in cfg.items():
        if key != "sampling":
            flat.append((key, v))
        elif isinstance(v, dict):
            flat += [(f"sampling.{k}", sv) for k, sv in v.items()]
        else:
            out.rejected_keys[key] = "sampling must be an object"
    return flat


def classify(cfg: dict[str, Any]) -> Classified:
    out = Classified()
    for key, v in _flatten(cfg, out):
        if key in NO_EFFECT and not (key in GPU_KEYS and _gpu_backend()):
            out.rejected_keys[key] = f"no effect in this engine: {NO_EFFECT[key]}"
            continue
        if key in _DENIED_UNTYPED:
            out.rejected_keys[key] = DENIED
            continue
        try:
            param = lookup(key)
            value = param.validate(v)
        except UnknownParam:
            out.unrecognized_keys.append(key)
            continue
        except ParamError as e:
            out.rejected_keys[key] = e.reason.replace(param.key, key, 1)
            continue
        if param.tier == "startup":
            out.rejected_keys[key] = DENIED
        elif param.tier == "T1":
            if param.key == "state_chunk_size":
                value = min(max(value, STATE_CHUNK_MIN), STATE_CHUNK_MAX)
            out.t1[param.key] = list(value) if isinstance(value, tuple) else value
        else:
            out.staged[param.key] = value
            out.deferred_keys.append(key)
            out.bump(param.tier)
    return out


def refuse_unbuildable(c: Classified, params: "ModelParams", kv_cache: "KvCacheInfo | None",
                       resolve_model: "Callable[[str], Any]", rpc_allow: "RpcAllowList",
                       model_problem: "Callable[[str], str | None] | None" = None) -> None:
    """Move the staged keys the engine must not try to ``rejected_keys``, before any reload:

    * a ``model`` that is no model file (missing, unreadable, not a GGUF: the backend's
      ``model_problem``), so the answer says so instead of a reload failing later;
    * a context llama.cpp could not build (the keys that ask for it; ``kv_cache.build_problem``);
    * ``rpc_servers`` naming a server off the start-up allow-list (``engine.rpc_allow``).
    """
    from .kv_cache import KV_SHAPE_KEYS, build_problem
    from .kv_layout import available_memory
    from .model_params import resolve_path

    if "model" in c.staged and model_problem is not None:
        why = model_problem(resolve_path(resolve_model, c.staged["model"]))
        if why:
            c.reject("model", why)

    asked = KV_SHAPE_KEYS & set(c.staged)
    if asked:
        p = params.derive(c.staged, resolve_model)
        why = build_problem(p, kv_cache if "model" not in c.staged else None, available_memory())
        for key in asked if why else ():
            c.reject(key, why)
    why = rpc_allow.refusal(c.staged["rpc_servers"]) if "rpc_servers" in c.staged else None
    if why:
        c.reject("rpc_servers", why)
