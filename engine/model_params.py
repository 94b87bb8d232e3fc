"""What a model and its context are built from (``ModelParams``), and how a staged CONFIGURE
derives new ones.

Field names are the keys of engine/params_table.py and mean what llama-server means by them
(docs/llama-args.md): ``n_ctx`` is the *total* context of all slots (0: the model's training
context), split into slots by llama-server's rule (engine/kv_layout.py); ``n_slots`` is
``--parallel``. Values arrive typed and range-checked (``params_table``), so deriving never
fails on a value.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any, Callable

from codec.seqstate import KV_TYPE_BLOCKS

from .params_table import GPU_LAYERS_ALL, GPU_LAYERS_AUTO

#: staged keys that only change how the model is built or served: they name a field directly
_DIRECT = ("n_ctx", "cache_type_k", "cache_type_v", "rope_scaling", "rope_freq_base", "rope_freq_scale",
           "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow", "flash_attn", "kv_unified",
           "ubatch_size", "swa_full", "offload_kqv", "load_mode", "repack", "no_host", "check_tensors",
           "n_gpu_layers", "rpc_servers", "n_cpu_moe", "cpu_moe", "override_tensor", "cache_prompt",
           "cache_reuse", "context_shift", "jinja", "chat_template", "split_mode", "tensor_split")
# llama.cpp's load modes as (mmap, mlock) bits; "dio" and "none" use neither
_LOAD_BITS = {"auto": 1, "none": 0, "mmap": 1, "mlock": 2, "mmap+mlock": 3, "dio": 0}
_LOAD_NAMES = {0: "none", 1: "mmap", 2: "mlock", 3: "mmap+mlock"}


def decode_capacity(n_ctx: int, n_batch: int) -> int:
    """The tokens one ``llama_decode`` takes: llama.cpp caps n_batch at n_ctx (0: the model's
    training context, not known here) for causal attention."""
    return min(n_ctx, n_batch) if n_ctx > 0 else n_batch


@dataclass(frozen=True)
class ModelParams:
    """Everything a backend factory needs to build a model; a staged CONFIGURE derives a new one.

    Frozen and compared by value: a reload is needed exactly when the derived params differ.
    """

    model_path: str
    # context
    n_ctx: int = 0
    n_slots: int = 4
    kv_unified: bool = True
    n_ctx_slot_cap: int = 0  # --kv-unified-per-slot (0: none)
    n_batch: int = 512
    ubatch_size: int = 512
    n_threads: int | None = None  # None: every core
    n_threads_batch: int | None = None  # None: n_threads
    flash_attn: str = "auto"  # on | off | auto
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    rope_scaling: str | None = None  # none | linear | yarn (None: the model's)
    rope_freq_base: float = 0.0  # 0: the model's
    rope_freq_scale: float = 0.0
    yarn_ext_factor: float = -1.0
    yarn_attn_factor: float = -1.0
    yarn_beta_fast: float = -1.0
    yarn_beta_slow: float = -1.0
    swa_full: bool = False
    offload_kqv: bool = True
    # model
    n_gpu_layers: int = GPU_LAYERS_AUTO  # N, or GPU_LAYERS_AUTO / GPU_LAYERS_ALL
    rpc_servers: tuple[str, ...] = ()
    override_tensor: tuple[tuple[str, str], ...] = ()
    # device options (engine/gpu.py): applied with a GPU backend, without effect on a CPU build
    split_mode: str = "layer"  # none | layer | row | tensor
    tensor_split: tuple[float, ...] = ()
    main_gpu: int = 0
    devices: tuple[str, ...] = ()  # --device: offload device names ("none": none); empty: llama.cpp's choice
    n_cpu_moe: int = 0
    cpu_moe: bool = False
    load_mode: str = "auto"
    repack: bool = True
    no_host: bool = False
    check_tensors: bool = False
    # chat and serving
    chat_template: str | None = None  # Jinja source (None: the GGUF's)
    jinja: bool = True
    chat_template_kwargs: str = "{}"  # a JSON object, kept as text so the params stay hashable
    cache_prompt: bool = True  # the prompt cache (engine/prompt_cache.py)
    cache_reuse: int = 0  # its KV-shift chunk reuse: min chunk size (0: off)
    context_shift: bool = False

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return json.loads(self.chat_template_kwargs)

    @property
    def gpu_layers(self) -> str | int:
        """n_gpu_layers as llama-server prints it (a number, "auto" or "all")."""
        return {GPU_LAYERS_AUTO: "auto", GPU_LAYERS_ALL: "all"}.get(self.n_gpu_layers, self.n_gpu_layers)

    def derive(self, staged: dict[str, Any], resolve_model: Callable[[str], Any]) -> "ModelParams":
        """Apply staged T2/T3/T4 values (typed by engine/params_table.py, canonical keys)."""
        changes: dict[str, Any] = {k: v for k, v in staged.items() if k in _DIRECT}
        if "model" in staged:
            changes["model_path"] = resolve_path(resolve_model, staged["model"])
        if "rope_scale" in staged:  # llama.cpp keeps only rope_freq_scale = 1/N
            changes["rope_freq_scale"] = 1.0 / staged["rope_scale"]
        if "chat_template_kwargs" in staged or "reasoning" in staged:
            kwargs = dict(staged.get("chat_template_kwargs", self.template_kwargs))
            if staged.get("reasoning") in ("on", "off"):
                kwargs["enable_thinking"] = staged["reasoning"] == "on"
            changes["chat_template_kwargs"] = json.dumps(kwargs, sort_keys=True)
        if "use_mmap" in staged or "use_mlock" in staged:
            bits = _LOAD_BITS[changes.get("load_mode", self.load_mode)]
            for key, bit in (("use_mmap", 1), ("use_mlock", 2)):
                if key in staged:
                    bits = bits | bit if staged[key] else bits & ~bit
            changes["load_mode"] = _LOAD_NAMES[bits]
        return replace(self, **changes)

    def conflict(self) -> str | None:
        """Why llama.cpp would refuse to create this context whatever the model, or None."""
        if self.flash_attn == "off" and KV_TYPE_BLOCKS[self.cache_type_v][0] > 1:
            return f"a quantized V cache ({self.cache_type_v}) needs flash attention (flash_attn on or auto)"
        # llama.cpp aborts the process when a batch cannot hold a token of every sequence
        # (engine/llama_backend/context.py: create_context)
        batch = decode_capacity(self.n_ctx, self.n_batch)
        if batch < self.n_slots:
            return (f"a batch of {batch} tokens (n_ctx {self.n_ctx}, n_batch {self.n_batch}) cannot hold a token "
                    f"of each of the {self.n_slots} slots")
        return None

    def as_dict(self) -> dict[str, Any]:
        """JSON-able, for INFO (the chat template by its size, not its text)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["chat_template"] = None if self.chat_template is None else f"{len(self.chat_template)} characters"
        out["chat_template_kwargs"] = self.template_kwargs
        out["n_gpu_layers"] = self.gpu_layers
        out["override_tensor"] = [f"{p}={b}" for p, b in self.override_tensor]
        out["rpc_servers"] = list(self.rpc_servers)
        out["tensor_split"] = list(self.tensor_split)
        out["devices"] = list(self.devices)
        return out


def resolve_path(resolve_model: Callable[[str], Any], spec: str) -> str:
    """A model name or path → the file to load. A name that does not resolve is kept as it is:
    the build then fails and the reload reports it (a failed reload, not a refused request)."""
    try:
        return str(resolve_model(spec))
    except (OSError, ValueError):
        return spec
