"""The production ``BackendFactory`` (``engine.backend``): llama.cpp through llama-cpp-python.

Injected through ``EngineConfig.backend``; the engine above it knows only the protocol, so
this module is the one way from the engine's configuration into ``engine.llama_backend``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from ..backend import ModelBackend
    from ..model_params import ModelParams


class LlamaFactory:
    """Builds :class:`LoadedModel` s. ``llama_env``: the variables llama.cpp reads from the
    process environment itself (``EngineConfig.llama_env``), so that what a context reports
    of them is what the engine was configured with; None: the environment at each build."""

    def __init__(self, llama_env: Mapping[str, str] | None = None) -> None:
        self.llama_env = dict(llama_env) if llama_env is not None else None

    def check(self) -> None:
        from .runtime import check_rpc_support

        check_rpc_support()  # a wheel built without GGML_RPC is a broken install

    def build(self, params: "ModelParams", progress: "Callable[[float], None] | None" = None) -> "ModelBackend":
        from .build import load

        if params.rpc_servers:
            from ..ggml_rpc_lib import register_rpc_server

            for ep in params.rpc_servers:
                register_rpc_server(ep)
        return load(params, progress, llama_env=self.llama_env)

    @staticmethod
    def model_problem(path: str) -> str | None:
        """Why ``path`` cannot be loaded as a model (a CONFIGURE ``model`` is refused for it), or None."""
        return gguf_problem(path)

    def devices(self, params: "ModelParams") -> list[str]:
        """Devices in the ggml backend registry: CPU, a GPU build's (CUDA0, Vulkan0, ROCm0, …),
        ``RPC0[host:port]`` for remote layers."""
        from ..gpu import registry_for

        return [f"{d.name}[{d.description}]" if d.is_rpc else d.name for d in registry_for(params.rpc_servers)]

    def backend_devices(self) -> list[dict[str, Any]]:
        """The registry's devices with their description, type and backend (INFO ``backend_devices``)."""
        from ..gpu import backend_devices

        return [d.as_dict() for d in backend_devices()]


GGUF_MAGIC = b"GGUF"


def gguf_problem(path: str) -> str | None:
    """Why ``path`` is not a GGUF model file this process can read, or None. Only the magic
    is read: whether llama.cpp takes the rest is for the build to say."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        return f"model file {path} does not exist"
    except IsADirectoryError:
        return f"model path {path} is a directory, not a GGUF file"
    except OSError as e:
        return f"model file {path} cannot be read: {e.strerror or e}"
    if magic != GGUF_MAGIC:
        return f"model file {path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})"
    return None
