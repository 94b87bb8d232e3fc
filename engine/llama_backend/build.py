"""``ModelParams`` → a :class:`LoadedModel`: llama.cpp's model and context fields, as
llama-server's ``common_model_params_to_llama`` / ``common_context_params_to_llama`` set them.

Plus two checks llama.cpp does not make before it allocates: a KV cache that would not fit
in memory (it would be zero-filled in full, so an ``n_ctx`` of 2^24 takes the host down
rather than failing), and a quantized cache type whose blocks do not divide the model's rows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import llama_cpp.llama_cpp as L

from codec.errors import LocalProtocolError
from codec.seqstate import kv_row_size

from ..kv_layout import available_memory, slot_context
from ..model_params import ModelParams
from ..params_table import GPU_LAYERS_ALL, GPU_LAYERS_AUTO
from .identity import meta_value
from .runtime import LlamaBackendError

if TYPE_CHECKING:
    from .model import LoadedModel

FLASH_ATTN = {"on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED, "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED,
              "auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO}
ROPE_SCALING = {None: L.LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED, "none": L.LLAMA_ROPE_SCALING_TYPE_NONE,
                "linear": L.LLAMA_ROPE_SCALING_TYPE_LINEAR, "yarn": L.LLAMA_ROPE_SCALING_TYPE_YARN}
LOAD_MODE = {"auto": L.LLAMA_LOAD_MODE_AUTO, "none": L.LLAMA_LOAD_MODE_NONE, "mmap": L.LLAMA_LOAD_MODE_MMAP,
             "mlock": L.LLAMA_LOAD_MODE_MLOCK, "mmap+mlock": L.LLAMA_LOAD_MODE_MMAP_MLOCK,
             "dio": L.LLAMA_LOAD_MODE_DIRECT_IO}
#: ggml_type ids of llama.cpp's ``kv_cache_types``
CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q5_0": 6, "q5_1": 7}


def model_fields(p: ModelParams) -> dict[str, Any]:
    """``llama_model_params`` fields (tensor overrides are set by the factory: they need the
    ggml-RPC devices registered first)."""
    if not p.rpc_servers:
        ngl = 0  # a CPU build: nothing to offload to (INFO reports what was asked)
    elif p.n_gpu_layers in (GPU_LAYERS_AUTO, GPU_LAYERS_ALL):
        ngl = -1  # llama.h: a negative value means all layers
    else:
        ngl = p.n_gpu_layers
    return {"n_gpu_layers": ngl, "load_mode": LOAD_MODE[p.load_mode], "use_extra_bufts": p.repack,
            "no_host": p.no_host, "check_tensors": p.check_tensors}


def context_fields(p: ModelParams) -> dict[str, Any]:
    """``llama_context_params`` fields other than n_ctx / n_seq_max / n_batch / threads."""
    return {
        "n_ubatch": min(p.ubatch_size, p.n_batch), "flash_attn_type": FLASH_ATTN[p.flash_attn],
        "type_k": CACHE_TYPES[p.cache_type_k], "type_v": CACHE_TYPES[p.cache_type_v], "kv_unified": p.kv_unified,
        "rope_scaling_type": ROPE_SCALING[p.rope_scaling], "rope_freq_base": p.rope_freq_base,
        "rope_freq_scale": p.rope_freq_scale, "yarn_ext_factor": p.yarn_ext_factor,
        "yarn_attn_factor": p.yarn_attn_factor, "yarn_beta_fast": p.yarn_beta_fast,
        "yarn_beta_slow": p.yarn_beta_slow, "swa_full": p.swa_full, "offload_kqv": p.offload_kqv,
    }


def check_kv_fits(model: Any, p: ModelParams) -> None:
    """Raises LlamaBackendError, before anything is allocated, when
    its K and V would not fit in the memory available (an upper bound: every layer is counted
    at full context, also sliding-window ones)."""
    n_ctx_train = int(L.llama_model_n_ctx_train(model))
    sc = slot_context(p.n_ctx, p.n_slots, p.kv_unified, n_ctx_train=n_ctx_train,
                      kv_unified_per_slot=p.n_ctx_slot_cap)
    n_layer, n_head, n_head_kv = (int(f(model)) for f in (L.llama_model_n_layer, L.llama_model_n_head,
                                                          L.llama_model_n_head_kv))
    head = int(L.llama_model_n_embd(model)) // max(n_head, 1)
    arch = meta_value(model, "general.architecture") or ""
    head_k = int(meta_value(model, f"{arch}.attention.key_length") or head)
    head_v = int(meta_value(model, f"{arch}.attention.value_length") or head)
    try:
        kv_row_size(p.cache_type_k, head_k)  # llama.cpp views the cache one head at a time
        kv_row_size(p.cache_type_v, head_v)
        per_cell = n_layer * (kv_row_size(p.cache_type_k, head_k * n_head_kv)
                              + kv_row_size(p.cache_type_v, head_v * n_head_kv))
    except LocalProtocolError as e:
        raise LlamaBackendError(f"cache types {p.cache_type_k}/{p.cache_type_v} do not fit this model's "
                                f"attention heads ({head_k}/{head_v} elements): {e}") from None
    need, have = per_cell * sc.n_ctx, available_memory()
    if need > have:
        raise LlamaBackendError(
            f"a KV cache of {sc.n_ctx} cells needs {need >> 20} MiB ({per_cell} bytes per cell); "
            f"{have >> 20} MiB of memory is available: lower n_ctx (--ctx-size) or use a quantized cache type")


def load(p: ModelParams, progress: "Callable[[float], None] | None" = None) -> "LoadedModel":
    """Load ``p``'s model and create its context (blocking; the loader thread). ggml-RPC
    servers must be registered already; the KV cache is described before this returns.
    ``progress`` gets llama.cpp's load progress (0..1)."""
    from ..tensor_overrides import build_tensor_overrides
    from .model import LoadedModel

    try:
        overrides = build_tensor_overrides(p.override_tensor, p.n_cpu_moe, p.cpu_moe)
    except ValueError as e:
        raise LlamaBackendError(f"override_tensor: {e}") from None
    mfields = model_fields(p)
    if overrides.patterns:
        mfields["tensor_buft_overrides"] = overrides.as_param()
    model = LoadedModel(p.model_path, n_ctx=p.n_ctx, n_seq_max=p.n_slots, n_batch=p.n_batch, n_threads=p.n_threads,
                        n_gpu_layers=mfields.pop("n_gpu_layers"), extra_model_params=mfields,
                        extra_ctx_params=context_fields(p), kv_unified=p.kv_unified,
                        n_threads_batch=p.n_threads_batch, n_ctx_slot_cap=p.n_ctx_slot_cap,
                        chat_template=p.chat_template, jinja=p.jinja, chat_kwargs=p.template_kwargs,
                        before_context=lambda m: check_kv_fits(m, p), progress=progress)
    try:
        model.kv_cache  # noqa: B018 - described here, off the event loop
        model.tensor_overrides = overrides.report(str(p.model_path)) if overrides.patterns else ()
    except BaseException:
        model.close()
        raise
    return model
