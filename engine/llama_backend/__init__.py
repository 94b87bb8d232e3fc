"""The llama.cpp backend: a thin synchronous wrapper over llama-cpp-python's ctypes API.

The only package that imports ``llama_cpp``. Modules: ``runtime`` (backend init, the log
ring, errors), ``model`` (:class:`LoadedModel`: model + context + the batched decode), its
parts ``context`` (the llama.cpp handles), ``model_text`` (tokens, chat prompts) and
``seq_state`` (sequence states), ``batch``, ``vocab``, ``sampler`` / ``grammar_sampler``,
``chat_template``, ``identity``, ``kv_probe``; ``build`` (ModelParams → LoadedModel) and
``factory`` (the engine's ``BackendFactory``).
"""
from ..backend import BatchItem
from ..sampling import SamplerParams
from .model import LoadedModel
from .runtime import (
    DecodeError,
    LlamaBackendError,
    StateError,
    check_rpc_support,
    last_llama_errors,
    set_llama_logging,
)
from .sampler import Sampler, make_sampler

__all__ = [
    "BatchItem", "DecodeError", "LlamaBackendError", "LoadedModel", "Sampler", "SamplerParams", "StateError",
    "check_rpc_support", "last_llama_errors", "make_sampler", "set_llama_logging",
]
