"""One typed table of engine parameters: llama.cpp CLI names, CONFIGURE keys, type, range, tier.

The same table types a value whether it arrives on the command line (``--flash-attn on``,
``LLAMA_ARG_FLASH_ATTN=on``) or in JSON (CONFIGURE / PREFILL ``hydra_config``
``{"flash_attn": "on"}``), so a value llama.cpp would assert on never reaches it and a
reload never fails because of a value's type (see docs/llama-args.md).

Command-line text is converted the way llama.cpp's handlers do (``std::stoi`` / ``stof`` /
``stoul`` prefixes, ``on|enabled|true|1`` …); JSON values must have the JSON type the key
needs. Ranges are llama.cpp's where it checks one, and bounds that keep a value from
sizing an allocation (``n_ctx``, ``n_batch``) where it does not.

Tiers follow engine/tiers.py (T1 at once; T2 new context; T3 new model; T4 other model or
context parameters → reload); ``startup`` parameters are set on the command line only (the
C++ engine denies them at runtime, or they have no CONFIGURE key).

The conversions, :class:`Param` and the per-kind validators live in engine/param_types.py;
every public name there is re-exported here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .param_types import (  # re-exported: importers keep using engine.params_table
    AUTOY,
    CONVERSIONS,
    FALSEY,
    GPU_LAYERS_ALL,
    GPU_LAYERS_AUTO,
    I32_MAX,
    I32_MIN,
    KV_CACHE_TYPES,
    MAX_CTX,
    MAX_TEXT,
    TRUTHY,
    Param,
    ParamError,
    UnknownParam,
    onoffauto,
    stod,
    stof,
    stoi,
    stoul32,
)

__all__ = [
    "AUTOY",
    "BY_CLI",
    "BY_KEY",
    "CONVERSIONS",
    "CheckedConfig",
    "FALSEY",
    "GPU_LAYERS_ALL",
    "GPU_LAYERS_AUTO",
    "I32_MAX",
    "I32_MIN",
    "KV_CACHE_TYPES",
    "MAX_CTX",
    "MAX_TEXT",
    "PARAMS",
    "Param",
    "ParamError",
    "TRUTHY",
    "UnknownParam",
    "check_config",
    "lookup",
    "onoffauto",
    "stod",
    "stof",
    "stoi",
    "stoul32",
    "validate",
]


# ---- the table -----------------------------------------------------------------------------------

def _p(key, cli, kind, tier, default=None, **kw) -> Param:
    return Param(key, tuple(cli), kind, tier, default, **kw)


PARAMS: tuple[Param, ...] = (
    # T1: defaults of later requests, applied at once
    _p("sampling.temp", ["--temp", "--temperature"], "float", "T1", 0.8, lo=0.0, clamp=True,
       aliases=("temp", "temperature")),
    _p("sampling.top_k", ["--top-k"], "int", "T1", 40, lo=I32_MIN, hi=I32_MAX, aliases=("top_k",)),
    _p("sampling.top_p", ["--top-p"], "float", "T1", 0.95, lo=0.0, hi=1.0, aliases=("top_p",)),
    _p("sampling.min_p", ["--min-p"], "float", "T1", 0.05, lo=0.0, hi=1.0, aliases=("min_p",)),
    _p("sampling.penalty_repeat", ["--repeat-penalty"], "float", "T1", 1.0, lo=0.0,
       aliases=("repeat_penalty", "penalty_repeat")),
    _p("sampling.seed", ["-s", "--seed"], "seed", "T1", 0xFFFFFFFF, aliases=("seed",)),
    _p("n_predict", ["-n", "--predict", "--n-predict"], "int", "T1", -1, lo=-2, hi=I32_MAX),
    _p("n_keep", ["--keep"], "int", "T1", 0, lo=-1, hi=I32_MAX),
    _p("antiprompt", ["-r", "--reverse-prompt"], "str_list", "T1", (), repeat=True),
    _p("state_chunk_size", [], "int", "T1", 2 << 20, lo=0, hi=1 << 40),
    # T2: a new context
    _p("n_ctx", ["-c", "--ctx-size"], "int", "T2", 0, lo=0, hi=MAX_CTX),
    _p("cache_type_k", ["-ctk", "--cache-type-k"], "enum", "T2", "f16", choices=KV_CACHE_TYPES),
    _p("cache_type_v", ["-ctv", "--cache-type-v"], "enum", "T2", "f16", choices=KV_CACHE_TYPES),
    _p("rope_scaling", ["--rope-scaling"], "enum", "T2", None, choices=("none", "linear", "yarn")),
    _p("rope_scale", ["--rope-scale"], "float", "T2", None, lo=1e-6, hi=1e6),  # the C++ takes 1/x
    _p("rope_freq_base", ["--rope-freq-base"], "float", "T2", 0.0, lo=0.0, hi=1e12),
    _p("rope_freq_scale", ["--rope-freq-scale"], "float", "T2", 0.0, lo=0.0, hi=1e6),
    # T3: a new model
    _p("model", ["-m", "--model"], "model", "T3", None, hi=4096, aliases=("model_path", "model.path")),
    _p("n_gpu_layers", ["-ngl", "--gpu-layers", "--n-gpu-layers"], "gpu_layers", "T3", GPU_LAYERS_AUTO),
    _p("rpc_servers", ["--rpc"], "hostports", "T3", ()),
    _p("n_cpu_moe", ["-ncmoe", "--n-cpu-moe"], "int", "T3", 0, lo=0, hi=4096),
    _p("cpu_moe", ["-cmoe", "--cpu-moe"], "bool", "T3", False),
    _p("override_tensor", ["-ot", "--override-tensor"], "overrides", "T3", (), repeat=True),
    _p("split_mode", ["-sm", "--split-mode"], "enum", "T3", "layer", choices=("none", "layer", "row", "tensor")),
    _p("tensor_split", ["-ts", "--tensor-split"], "float_list", "T3", ()),
    # T4: other model / context parameters (reload)
    _p("flash_attn", ["-fa", "--flash-attn"], "onoffauto", "T4", "auto"),
    _p("kv_unified", ["-kvu", "--kv-unified"], "bool", "T4", False),
    _p("ubatch_size", ["-ub", "--ubatch-size"], "int", "T4", 512, lo=1, hi=1 << 20),
    _p("yarn_orig_ctx", ["--yarn-orig-ctx"], "int", "T4", 0, lo=0, hi=MAX_CTX),
    _p("yarn_ext_factor", ["--yarn-ext-factor"], "float", "T4", -1.0, lo=-1.0, hi=1e3),
    _p("yarn_attn_factor", ["--yarn-attn-factor"], "float", "T4", -1.0, lo=-1.0, hi=1e3),
    _p("yarn_beta_fast", ["--yarn-beta-fast"], "float", "T4", -1.0, lo=-1.0, hi=1e4),
    _p("yarn_beta_slow", ["--yarn-beta-slow"], "float", "T4", -1.0, lo=-1.0, hi=1e4),
    _p("swa_full", ["--swa-full"], "bool", "T4", False),
    _p("offload_kqv", ["-kvo", "--kv-offload"], "bool", "T4", True, aliases=("kv_offload",)),
    _p("load_mode", ["-lm", "--load-mode"], "enum", "T4", "auto",
       choices=("auto", "none", "mmap", "mlock", "mmap+mlock", "dio")),
    _p("use_mmap", [], "bool", "T4", True),
    _p("use_mlock", [], "bool", "T4", False),
    _p("repack", ["--repack"], "bool", "T4", True),
    _p("no_host", ["--no-host"], "bool", "T4", False),
    _p("check_tensors", ["--check-tensors"], "bool", "T4", False),
    _p("cache_prompt", ["--cache-prompt"], "bool", "T4", True),
    _p("cache_reuse", ["--cache-reuse"], "int", "T4", 0, lo=0, hi=I32_MAX),
    _p("context_shift", ["--context-shift"], "bool", "T4", False),
    _p("cont_batching", ["-cb", "--cont-batching"], "bool", "T4", True),
    _p("jinja", ["--jinja"], "bool", "T4", True),
    _p("reasoning", ["-rea", "--reasoning"], "onoffauto", "T4", "auto"),
    _p("chat_template_kwargs", ["--chat-template-kwargs"], "json_object", "T4", None),
    _p("chat_template", ["--chat-template"], "str", "T4", None, hi=MAX_TEXT),
    # startup: command line only (the C++ denies these at runtime, or they have no CONFIGURE key)
    _p("n_batch", ["-b", "--batch-size"], "int", "startup", 2048, lo=1, hi=1 << 20),
    _p("n_parallel", ["-np", "--parallel"], "int", "startup", -1, lo=-1, hi=256, refused=(0,)),
    _p("threads", ["-t", "--threads"], "int", "startup", -1, lo=I32_MIN, hi=1024),
    _p("threads_batch", ["-tb", "--threads-batch"], "int", "startup", -1, lo=I32_MIN, hi=1024),
    _p("main_gpu", ["-mg", "--main-gpu"], "int", "startup", 0, lo=0, hi=I32_MAX),
    _p("devices", ["-dev", "--device"], "str_list", "startup", ()),
    _p("kv_unified_per_slot", ["--kv-unified-per-slot"], "int", "startup", 0, lo=0, hi=MAX_CTX, config=False),
    _p("chat_template_file", ["--chat-template-file"], "str", "startup", None, hi=4096, config=False),
    # the prompt cache's start-up settings (cache_prompt and cache_reuse above are T4)
    _p("cache_ram", ["-cram", "--cache-ram"], "int", "startup", 8192, lo=-1, hi=I32_MAX, config=False),
    _p("slot_prompt_similarity", ["-sps", "--slot-prompt-similarity"], "float", "startup", 0.1, lo=0.0, hi=1.0,
       config=False),
    _p("slot_save_path", ["--slot-save-path"], "str", "startup", None, hi=4096, config=False),
    _p("ctx_checkpoints", ["-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"], "int", "startup", 32, lo=0,
       hi=I32_MAX, config=False),
    _p("checkpoint_min_step", ["-cms", "--checkpoint-min-step"], "int", "startup", 8192, lo=0, hi=I32_MAX,
       config=False),
    _p("host", ["--host"], "str_list", "startup", ("127.0.0.1",), config=False),
    _p("port", ["--port"], "int", "startup", 8080, lo=0, hi=65535, config=False),
    _p("timeout", ["-to", "--timeout"], "int", "startup", 3600, lo=0, hi=I32_MAX, config=False),
    _p("metrics", ["--metrics"], "bool", "startup", False, config=False),
    _p("slots", ["--slots"], "bool", "startup", True, config=False),
    _p("prio", ["--prio"], "int", "startup", 0, lo=-1, hi=3, config=False),
    _p("prio_batch", ["--prio-batch"], "int", "startup", 0, lo=0, hi=3, config=False),
    _p("alias", ["-a", "--alias"], "str_list", "startup", (), repeat=True, config=False),
    # llama-engine's own arguments (the Hydra fork strips them before llama.cpp's parser)
    _p("rpc_port", ["--rpc-port"], "int", "startup", 0, lo=0, hi=65535, config=False),
    _p("ggml_rpc_port", ["--ggml-rpc-port"], "int", "startup", 0, lo=0, hi=65535, config=False),
    _p("rpc_engine", ["--rpc-engine"], "hostports", "startup", (), config=False),
    _p("peer_only", ["--peer-only"], "bool", "startup", False, config=False),
    _p("combined_ot_pattern", ["--combined-ot-pattern"], "str", "startup", None, config=False),
    _p("combined_split_mode", ["--combined-split-mode"], "enum", "startup", "expert", choices=("expert", "layer"),
       config=False),
    _p("combined_tensor_split", ["--combined-tensor-split"], "float_list", "startup", (), config=False),
    _p("yarn_ext_ctx", ["--yarn-ext-ctx"], "int", "startup", 0, lo=0, hi=MAX_CTX, config=False),
)

BY_KEY: dict[str, Param] = {}
BY_CLI: dict[str, Param] = {}
for _param in PARAMS:
    for _name in (_param.key, *_param.aliases):
        assert _name not in BY_KEY, _name
        BY_KEY[_name] = _param
    for _name in _param.cli:
        assert _name not in BY_CLI, _name
        BY_CLI[_name] = _param


def lookup(key: str) -> Param:
    """The parameter a CONFIGURE key (or alias) names; UnknownParam otherwise."""
    p = BY_KEY.get(key) if isinstance(key, str) else None
    if p is None or not p.config:
        raise UnknownParam(str(key)[:80], f"unknown parameter {str(key)[:80]!r}")
    return p


def validate(key: str, value: Any) -> Any:
    """The typed value of ``{key: value}``; raises only ParamError (UnknownParam for a key
    this table does not know). The reason names the key as sent."""
    p = lookup(key)
    try:
        return p.validate(value)
    except ParamError as e:
        if key == p.key:
            raise
        raise ParamError(key, key + e.reason.removeprefix(p.key)) from None


@dataclass
class CheckedConfig:
    values: dict[str, Any]  # canonical key → typed value
    rejected: dict[str, str]  # key as sent → reason
    unknown: list[str]


def check_config(cfg: dict[str, Any]) -> CheckedConfig:
    """Type every key of a CONFIGURE / ``hydra_config`` object (``sampling`` may nest)."""
    out = CheckedConfig({}, {}, [])
    flat: list[tuple[str, Any]] = []
    for key, v in cfg.items():
        if key == "sampling" and isinstance(v, dict):
            flat += [(f"sampling.{k}", sv) for k, sv in v.items()]
        else:
            flat.append((key, v))
    for key, v in flat:
        try:
            out.values[lookup(key).key] = validate(key, v)
        except UnknownParam:
            out.unknown.append(key)
        except ParamError as e:
            out.rejected[key] = e.reason
    return out
