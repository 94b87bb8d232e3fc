"""What the installed llama.cpp build can offload to, and how many layers a model put there.

llama-cpp-python's wheel is built with whatever ``LCP_CMAKE_ARGS`` said
(scripts/install_llama_cpp.sh): the default is a CPU build (plus ggml-RPC); ``-DGGML_CUDA=ON``,
``-DGGML_VULKAN=ON`` or ``-DGGML_HIP=ON`` add a GPU backend whose devices appear in ggml's
backend registry. This module reads that registry through the libggml libllama itself uses
(engine/ggml_rpc_lib.py: ``ggml_backend_dev_count/get/name/description/type``, which
llama-cpp-python's own bindings do not expose) and computes the offload exactly as llama.cpp's
``llama_model_load_from_file`` and ``load_tensors`` do it:

* the model's offload devices (split mode ``layer``/``row``): the ggml-RPC devices first, then the
  discrete GPUs, then the integrated GPUs only when there is no discrete one; ``--device`` names
  them instead (``none``: none); split mode ``none`` keeps only ``--main-gpu``;
* layers offloaded: ``0`` without an offload device, else ``min(n_gpu_layers, n_layer + 1)``
  (a negative ``n_gpu_layers`` — ``auto``/``all`` — meaning all ``n_layer + 1``, the output
  layer counting as one).

Nothing here imports llama_cpp: INFO, the argument table and the tests read the registry alone.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["BackendDevice", "Offload", "backend_devices", "gpu_backend", "registry_for", "offload_devices",
           "layers_offloaded", "GPU_TYPES"]

#: ggml_backend_dev_type values whose devices take offloaded layers (RPC devices are "GPU" too)
GPU_TYPES = ("GPU", "IGPU")


@dataclass(frozen=True)
class BackendDevice:
    """One device of ggml's backend registry (``ggml_backend_dev_*``)."""

    name: str  # CPU, CUDA0, Vulkan0, ROCm0, RPC0[host:port] is reported as name + description
    description: str
    type: str  # CPU | GPU | IGPU | ACCEL | META
    backend: str  # the registry it belongs to: CPU, CUDA, Vulkan, ROCm, RPC, …

    @property
    def is_rpc(self) -> bool:
        return self.backend == "RPC"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "type": self.type, "backend": self.backend}


@dataclass(frozen=True)
class Offload:
    """How a loaded model was placed (INFO / ``/props`` ``gpu_offload``)."""

    n_gpu_layers: str | int  # what was asked, as llama-server prints it (N, auto, all)
    n_gpu_layers_applied: int  # what llama.cpp was given (-1: all; 0 on a build with nowhere to offload)
    n_layers: int  # offloadable layers: the repeating ones + the output layer
    n_layers_offloaded: int
    devices: tuple[str, ...] = ()  # the model's offload devices, in llama.cpp's order
    gpu_backend: bool = False  # the build has a local GPU backend
    settings: dict[str, Any] = field(default_factory=dict)  # split_mode, main_gpu, tensor_split, devices given

    def as_dict(self) -> dict[str, Any]:
        return {"n_gpu_layers": self.n_gpu_layers, "n_gpu_layers_applied": self.n_gpu_layers_applied,
                "n_layers": self.n_layers, "n_layers_offloaded": self.n_layers_offloaded,
                "devices": list(self.devices), "gpu_backend": self.gpu_backend, **self.settings}


_DEV_TYPES = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL", 4: "META"}


def _lib() -> ctypes.CDLL:
    from .ggml_rpc_lib import libggml

    g = libggml()
    vp = ctypes.c_void_p
    g.ggml_backend_dev_backend_reg.restype = vp
    g.ggml_backend_dev_backend_reg.argtypes = [vp]
    g.ggml_backend_reg_name.restype = ctypes.c_char_p
    g.ggml_backend_reg_name.argtypes = [vp]
    return g


def _text(raw: bytes | None) -> str:
    return (raw or b"").decode("utf-8", "replace")


def backend_devices() -> tuple[BackendDevice, ...]:
    """Every device in the registry libllama uses, in registry order (CPU first on a CPU build;
    ggml-RPC devices appear once a server is registered)."""
    g = _lib()
    out = []
    for i in range(int(g.ggml_backend_dev_count())):
        dev = g.ggml_backend_dev_get(i)
        t = int(g.ggml_backend_dev_type(dev))
        reg = g.ggml_backend_dev_backend_reg(dev)
        out.append(BackendDevice(_text(g.ggml_backend_dev_name(dev)), _text(g.ggml_backend_dev_description(dev)),
                                 _DEV_TYPES.get(t, str(t)), _text(g.ggml_backend_reg_name(reg)) if reg else ""))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _local_gpu_backend() -> bool:
    # local GPU devices are registered when libggml loads and never go away: cached. ggml-RPC
    # devices come later (registration) and do not count.
    return any(d.type in GPU_TYPES and not d.is_rpc for d in backend_devices())


def gpu_backend() -> bool:
    """Whether the installed llama.cpp build has a local GPU backend with at least one device
    (CUDA, Vulkan, ROCm/HIP, Metal, SYCL, …). False when llama-cpp-python is not installed."""
    try:
        return _local_gpu_backend()
    except (RuntimeError, OSError, AttributeError):
        return False


def registry_for(rpc_servers: Sequence[str], devices: Sequence[BackendDevice] | None = None
                 ) -> tuple[BackendDevice, ...]:
    """The registry as a model built with ``rpc_servers`` sees it: ggml-RPC registration cannot be
    undone, so the devices of servers a reload dropped are left out (``--device`` lists the
    rest to llama.cpp when any are present)."""
    devs = backend_devices() if devices is None else devices
    return tuple(d for d in devs if not d.is_rpc or d.description in rpc_servers)


def offload_devices(devices: Sequence[BackendDevice], *, split_mode: str = "layer", main_gpu: int = 0,
                    names: Sequence[str] = ()) -> tuple[BackendDevice, ...]:
    """The devices llama.cpp's model load offloads to (``llama_model_load_from_file``'s choice)."""
    if names:
        chosen = [] if list(names) == ["none"] else [d for n in names for d in devices if d.name == n]
    else:
        rpc = [d for d in devices if d.type == "GPU" and d.is_rpc]
        gpus = [d for d in devices if d.type == "GPU" and not d.is_rpc]
        igpus = [d for d in devices if d.type == "IGPU"] if not gpus else []
        igpus = [d for d in igpus if d.backend == igpus[0].backend] if igpus else []
        chosen = rpc + gpus + igpus
    if split_mode == "none" and chosen:
        chosen = [chosen[main_gpu]] if 0 <= main_gpu < len(chosen) else []
    return tuple(chosen)


def layers_offloaded(n_gpu_layers_applied: int, n_layer: int, n_devices: int) -> int:
    """llama.cpp's ``act_gpu_layers``: the layers (of ``n_layer + 1``) placed on offload devices."""
    if n_devices == 0:
        return 0
    total = n_layer + 1
    return total if n_gpu_layers_applied < 0 else min(n_gpu_layers_applied, total)
