"""``ModelParams`` → a :class:`LoadedModel`: llama.cpp's model and context fields, as
llama-server's ``common_model_params_to_llama`` / ``common_context_params_to_llama`` set them.

Plus two checks llama.cpp does not make before it allocates: a KV cache that would not fit
in memory (it would be zero-filled in full, so an ``n_ctx`` of 2^24 takes the host down
rather than failing), and a quantized cache type whose blocks do not divide the model's rows.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Callable, Mapping

import llama_cpp.llama_cpp as L

from codec.errors import LocalProtocolError
from codec.seqstate import kv_row_size

from ..kv_layout import available_memory, slot_context
from ..model_params import ModelParams
from ..params_table import GPU_LAYERS_ALL, GPU_LAYERS_AUTO
from .identity import meta_value
from .runtime import LlamaBackendError

if TYPE_CHECKING:
    from ..gpu import Offload
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


SPLIT_MODE = {"none": 0, "layer": 1, "row": 2, "tensor": 3}  # llama.h enum llama_split_mode


def model_fields(p: ModelParams, gpu: bool | None = None) -> dict[str, Any]:
    """``llama_model_params`` fields (tensor overrides are set by the factory: they need the
    ggml-RPC devices registered first). ``gpu``: whether the build has a local GPU backend
    (engine/gpu.py; None: ask the registry). Without one and without ggml-RPC servers there is
    nowhere to offload: n_gpu_layers 0 and the device options unset (INFO reports what was
    asked). With one, the device options are applied as llama-server applies them; a
    ``_keep`` entry holds the ctypes arrays the pointer fields point into (the caller keeps it
    until the load returns)."""
    if gpu is None:
        from ..gpu import gpu_backend

        gpu = gpu_backend()
    if not p.rpc_servers and not gpu:
        ngl = 0  # a CPU build: nothing to offload to (INFO reports what was asked)
    elif p.n_gpu_layers in (GPU_LAYERS_AUTO, GPU_LAYERS_ALL):
        ngl = -1  # llama.h: a negative value means all layers
    else:
        ngl = p.n_gpu_layers
    out: dict[str, Any] = {"n_gpu_layers": ngl, "load_mode": LOAD_MODE[p.load_mode], "use_extra_bufts": p.repack,
                           "no_host": p.no_host, "check_tensors": p.check_tensors}
    if gpu:
        keep: list[Any] = []
        out["split_mode"] = SPLIT_MODE[p.split_mode]
        out["main_gpu"] = p.main_gpu
        if p.tensor_split:
            n_max = int(L.llama_max_devices())
            if len(p.tensor_split) > n_max:
                raise LlamaBackendError(f"tensor_split names {len(p.tensor_split)} devices; this build has at "
                                        f"most {n_max}")
            arr = (ctypes.c_float * n_max)(*p.tensor_split)
            keep.append(arr)
            out["tensor_split"] = ctypes.cast(arr, ctypes.POINTER(ctypes.c_float))
        names = p.devices or _without_dropped_rpc(p)
        if names:
            out["devices"] = _device_list(names, keep)
        out["_keep"] = keep
    return out


def _without_dropped_rpc(p: ModelParams) -> tuple[str, ...]:
    """llama.cpp's own device choice, minus ggml-RPC servers an earlier configuration registered
    and this one dropped (registration cannot be undone); () when nothing needs leaving out."""
    from ..gpu import backend_devices, offload_devices, registry_for

    every = backend_devices()
    seen = registry_for(p.rpc_servers, every)
    if len(seen) == len(every):
        return ()
    return tuple(d.name for d in offload_devices(seen, split_mode="layer")) or ("none",)


def _device_list(names: tuple[str, ...], keep: list[Any]) -> int:
    """A NULL-terminated ``ggml_backend_dev_t`` array of the devices named (``--device``), as
    llama-server's ``parse_device_list`` builds it: ``none`` alone means no device."""
    from ..ggml_rpc_lib import libggml

    g = libggml()
    devs = []
    if list(names) != ["none"]:
        for name in names:
            dev = g.ggml_backend_dev_by_name(name.encode())
            if not dev:
                raise LlamaBackendError(f"invalid device: {name}")
            devs.append(dev)
    arr = (ctypes.c_void_p * (len(devs) + 1))(*devs, None)
    keep.append(arr)
    return ctypes.cast(arr, ctypes.c_void_p).value or 0


def offload_report(p: ModelParams, n_gpu_layers_applied: int, n_layer: int) -> "Offload":
    """Where the layers went (INFO / ``/props`` ``gpu_offload``), by llama.cpp's rule."""
    from ..gpu import Offload, backend_devices, gpu_backend, layers_offloaded, offload_devices, registry_for

    gpu = gpu_backend()
    devs = offload_devices(registry_for(p.rpc_servers, backend_devices()), split_mode=p.split_mode if gpu else "layer",
                           main_gpu=p.main_gpu if gpu else 0, names=p.devices if gpu else ())
    settings = ({"split_mode": p.split_mode, "main_gpu": p.main_gpu, "tensor_split": list(p.tensor_split)}
                if gpu else {})
    return Offload(p.gpu_layers, n_gpu_layers_applied, n_layer + 1,
                   layers_offloaded(n_gpu_layers_applied, n_layer, len(devs)),
                   tuple(f"{d.name}[{d.description}]" if d.is_rpc else d.name for d in devs), gpu, settings)


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


def load(p: ModelParams, progress: "Callable[[float], None] | None" = None,
         llama_env: Mapping[str, str] | None = None) -> "LoadedModel":
    """Load ``p``'s model and create its context (blocking; the loader thread). ggml-RPC
    servers must be registered already; the KV cache is described before this returns.
    ``progress`` gets llama.cpp's load progress (0..1); ``llama_env``: see :class:`LoadedModel`."""
    from ..tensor_overrides import build_tensor_overrides
    from .model import LoadedModel

    try:
        overrides = build_tensor_overrides(p.override_tensor, p.n_cpu_moe, p.cpu_moe)
    except ValueError as e:
        raise LlamaBackendError(f"override_tensor: {e}") from None
    mfields = model_fields(p)
    keep = mfields.pop("_keep", None)  # the arrays the pointer fields point into: alive until loaded
    ngl = mfields["n_gpu_layers"]
    if overrides.patterns:
        mfields["tensor_buft_overrides"] = overrides.as_param()
    model = LoadedModel(p.model_path, n_ctx=p.n_ctx, n_seq_max=p.n_slots, n_batch=p.n_batch, n_threads=p.n_threads,
                        n_gpu_layers=mfields.pop("n_gpu_layers"), extra_model_params=mfields,
                        extra_ctx_params=context_fields(p), kv_unified=p.kv_unified,
                        n_threads_batch=p.n_threads_batch, n_ctx_slot_cap=p.n_ctx_slot_cap,
                        chat_template=p.chat_template, jinja=p.jinja, chat_kwargs=p.template_kwargs,
                        before_context=lambda m: check_kv_fits(m, p), progress=progress, llama_env=llama_env)
    del keep  # llama.cpp has copied what the pointers point to
    try:
        model.kv_cache  # noqa: B018 - described here, off the event loop
        model.tensor_overrides = overrides.report(str(p.model_path)) if overrides.patterns else ()
        model.gpu_offload = offload_report(p, ngl, model.n_layer)
    except BaseException:
        model.close()
        raise
    return model
