"""``--override-tensor``, ``--cpu-moe`` and ``--n-cpu-moe`` as llama.cpp's tensor buffer overrides.

llama-cpp-python 0.3.36 declares ``llama_model_params.tensor_buft_overrides`` as a bare
pointer and has no binding for the struct or for ggml's buffer types, so both come from
here: a NULL-terminated array of ``{const char *pattern; ggml_backend_buffer_type_t buft}``
and the buffer types of ggml's registered devices by name ("CPU", and one per ggml-RPC
server once registered), as common/arg.cpp looks them up.

The loader gives a tensor the buffer type of the first pattern that matches its name
(``std::regex_search``), so the order is kept: ``--override-tensor`` entries first, then the
MoE ones, which is the node agent's sorted order for the fleet's params.
"""
from __future__ import annotations

import ctypes
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import llama_cpp.llama_cpp as L

from .ggml_rpc_lib import libggml

# common/common.h: LLM_FFN_EXPS_REGEX and llm_ffn_block_regex()
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def moe_cpu_patterns(n_cpu_moe: int = 0, cpu_moe: bool = False) -> list[str]:
    """The patterns llama.cpp adds for ``--cpu-moe`` (all layers) / ``--n-cpu-moe N``."""
    if cpu_moe:
        return [FFN_EXPS_REGEX]
    return [rf"blk\.{i}{FFN_EXPS_REGEX}" for i in range(n_cpu_moe)]


class TensorBuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def buffer_types() -> dict[str, int]:
    """Buffer type handles of ggml's devices, by ``ggml_backend_buft_name``."""
    g = libggml()
    g.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    g.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    g.ggml_backend_buft_name.restype = ctypes.c_char_p
    g.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    out = {}
    for i in range(int(g.ggml_backend_dev_count())):
        buft = g.ggml_backend_dev_buffer_type(g.ggml_backend_dev_get(i))
        if buft:
            out[g.ggml_backend_buft_name(buft).decode("utf-8", "replace")] = buft
    return out


@dataclass
class TensorOverrides:
    """The array to hand to ``llama_model_params.tensor_buft_overrides``; it and the pattern
    strings it points to must stay alive until the model is loaded."""

    array: ctypes.Array
    patterns: list[bytes]
    bufts: list[str] = field(default_factory=list)  # the buffer type of each pattern

    def as_param(self) -> int | None:
        return ctypes.cast(self.array, ctypes.c_void_p).value if self.patterns else None

    def report(self, model_path: str) -> tuple[dict, ...]:
        """What each pattern moved in ``model_path`` (INFO ``tensor_overrides``): the tensors it
        is the first match for — the loader's rule (``std::regex_search``, first pattern wins)
        applied to the file's tensor names, so a pattern that matches nothing shows 0."""
        from gguf import GGUFReader

        names = [t.name for t in GGUFReader(model_path).tensors]
        compiled = [re.compile(p.decode()) for p in self.patterns]
        hits: list[list[str]] = [[] for _ in compiled]
        for name in names:
            for i, rx in enumerate(compiled):
                if rx.search(name):
                    hits[i].append(name)
                    break
        return tuple({"pattern": p.decode(), "buffer_type": b, "n_tensors": len(h), "tensors": h[:8]}
                     for p, b, h in zip(self.patterns, self.bufts, hits))


def build_tensor_overrides(
    override_tensor: Sequence[tuple[str, str]] = (), n_cpu_moe: int = 0, cpu_moe: bool = False
) -> TensorOverrides:
    """Overrides for ``(pattern, buffer type name)`` pairs plus the MoE ones (on CPU).

    An unknown buffer type raises ValueError listing the available ones, as llama.cpp does.
    """
    bufts = buffer_types()
    pairs = list(override_tensor) + [(p, "CPU") for p in moe_cpu_patterns(n_cpu_moe, cpu_moe)]
    limit = int(L.llama_max_tensor_buft_overrides())
    if len(pairs) >= limit:
        raise ValueError(f"{len(pairs)} tensor overrides; llama.cpp takes fewer than {limit}")
    for _, name in pairs:
        if name not in bufts:
            raise ValueError(f"unknown buffer type {name!r}; available: {', '.join(sorted(bufts))}")
    patterns = [p.encode() for p, _ in pairs]
    array = (TensorBuftOverride * (len(pairs) + 1))()  # zeroed: the last entry ends the list
    for i, (pattern, (_, name)) in enumerate(zip(patterns, pairs)):
        array[i].pattern, array[i].buft = pattern, bufts[name]
    return TensorOverrides(array, patterns, [name for _, name in pairs])
