"""CONFIGURE key classification, shared by CONFIGURE and PREFILL ``hydra_config`` (docs/protocol.md).

T1  applied at once to the defaults of later requests.
T2  needs a new context (same weights): ``n_ctx``, cache types, ``rope_*``.
T3  needs a new model: ``model``/``model_path``, ``n_gpu_layers``, ``rpc_servers``, …
T4  any other key that maps onto a llama.cpp model/context parameter of ours → reload.
Keys the C++ denies, keys with no equivalent here, and unknown keys are reported
(``rejected_keys`` / ``unrecognized_keys``) — the C++ computes these and hides them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

T1_SAMPLING = {"temp", "top_p", "top_k", "min_p", "penalty_repeat", "seed"}
T1_KEYS = {"n_predict", "n_keep", "seed", "antiprompt", "state_chunk_size"}
T2_KEYS = {"n_ctx", "cache_type_k", "cache_type_v"}
# T3 keys this engine honours (n_cpu_moe, override_tensor, split_mode, tensor_split: NO_EQUIVALENT)
T3_KEYS = {"model", "model_path", "model.path", "rpc_servers", "n_gpu_layers"}
# T4 keys we can honour, and the llama.cpp context/model parameter each one sets.
T4_CTX_PARAMS = {
    "flash_attn": "flash_attn_type",
    "kv_unified": "kv_unified",
    "ubatch_size": "n_ubatch",
    "yarn_orig_ctx": "yarn_orig_ctx",
    "yarn_ext_factor": "yarn_ext_factor",
    "yarn_attn_factor": "yarn_attn_factor",
    "yarn_beta_fast": "yarn_beta_fast",
    "yarn_beta_slow": "yarn_beta_slow",
    "swa_full": "swa_full",
    "offload_kqv": "offload_kqv",
}
# llama.cpp folds these two into one ``load_mode`` enum (see reload.ModelParams.derive)
T4_MODEL_PARAMS = {"use_mmap": "load_mode", "use_mlock": "load_mode"}
DENIED = {"n_batch", "threads", "threads_batch", "devices", "main_gpu", "n_parallel", "fit", "fit_print",
          "fit_target", "fit_ctx"}
# llama-server options that exist in the C++ but have no meaning in this engine.
NO_EQUIVALENT = {"cache_prompt", "cache_reuse", "chat_template_kwargs", "cont_batching", "context_shift", "jinja",
                 "reasoning", "spec_draft_ngl", "spec_draft_n_max", "spec_draft_p_min", "spec_type", "n_cpu_moe",
                 "override_tensor", "split_mode", "tensor_split"}
STATE_CHUNK_MIN, STATE_CHUNK_MAX, STATE_CHUNK_DEFAULT = 64 * 1024, 64 * 1024 * 1024, 2 * 1024 * 1024
TIER_ORDER = {"T1": 1, "T2": 2, "T3": 3, "T4": 4}


class ConfigError(ValueError):
    """A CONFIGURE value of the wrong type or out of range (whole request refused)."""


@dataclass
class Classified:
    t1: dict[str, Any] = field(default_factory=dict)  # dotted names → values
    staged: dict[str, Any] = field(default_factory=dict)  # T2/T3/T4 keys → values
    tier: str = "T1"
    deferred_keys: list[str] = field(default_factory=list)
    rejected_keys: dict[str, str] = field(default_factory=dict)
    unrecognized_keys: list[str] = field(default_factory=list)

    def bump(self, tier: str) -> None:
        if TIER_ORDER[tier] > TIER_ORDER[self.tier]:
            self.tier = tier


def _num(key: str, v: Any, kind=(int, float)) -> Any:
    if isinstance(v, bool) or not isinstance(v, kind):
        raise ConfigError(f"T1 key {key} has wrong type ({type(v).__name__})")
    if isinstance(v, float) and not math.isfinite(v):  # 1e400 parses to inf: not a usable value
        raise ConfigError(f"T1 key {key} must be finite")
    return v


def _t1_sampling(out: Classified, name: str, v: Any) -> None:
    kinds = {"top_k": int, "seed": int}
    out.t1[f"sampling.{name}"] = _num(f"sampling.{name}", v, kinds.get(name, (int, float)))


def classify(cfg: dict[str, Any]) -> Classified:
    out = Classified()
    for key, v in cfg.items():
        if key == "sampling":
            if not isinstance(v, dict):
                raise ConfigError("T1 key sampling must be an object")
            for name, sv in v.items():
                if name in T1_SAMPLING:
                    _t1_sampling(out, name, sv)
                else:
                    out.unrecognized_keys.append(f"sampling.{name}")
        elif key.startswith("sampling.") and key[9:] in T1_SAMPLING:
            _t1_sampling(out, key[9:], v)
        elif key in T1_KEYS:
            if key == "antiprompt":
                if not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
                    raise ConfigError("T1 key antiprompt must be a list of strings")
                out.t1[key] = v
            elif key == "state_chunk_size":
                n = _num(key, v, int)
                out.t1[key] = min(max(n, STATE_CHUNK_MIN), STATE_CHUNK_MAX)
            else:
                out.t1[key] = _num(key, v, int)
        elif key in T2_KEYS or key.startswith("rope_"):
            out.staged[key] = v
            out.deferred_keys.append(key)
            out.bump("T2")
        elif key in T3_KEYS:
            out.staged[key] = v
            out.deferred_keys.append(key)
            out.bump("T3")
        elif key in T4_CTX_PARAMS or key in T4_MODEL_PARAMS:
            out.staged[key] = v
            out.deferred_keys.append(key)
            out.bump("T4")
        elif key in DENIED:
            out.rejected_keys[key] = "denied: cannot change at runtime (as in the C++ engine)"
        elif key in NO_EQUIVALENT:
            out.rejected_keys[key] = "no equivalent in this engine"
        else:
            out.unrecognized_keys.append(key)
    return out


def model_path_of(staged: dict[str, Any]) -> str | None:
    """The model a staged config asks for (``model`` may be a string or ``{"path": ...}``)."""
    for key in ("model_path", "model.path"):
        if isinstance(staged.get(key), str):
            return staged[key]
    m = staged.get("model")
    if isinstance(m, str):
        return m
    if isinstance(m, dict) and isinstance(m.get("path"), str):
        return m["path"]
    return None
