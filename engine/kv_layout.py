"""llama.cpp's rules for the KV cache layout that no API reports, reproduced to be checked.

:func:`slot_context` — how llama-server turns ``--ctx-size``, ``--parallel`` and
``--kv-unified`` into per-slot context: the rule of llama.cpp's ``llama_context``
constructor and llama-server's ``n_ctx_slot()`` (see docs/llama-args.md), so ``--ctx-size``
and CONFIGURE ``n_ctx`` mean the total context here as they do in the C++ engine:

1. llama-server: ``--parallel -1`` (auto) becomes 4 slots with a unified KV cache; with
   ``--kv-unified-per-slot N`` and no ``--ctx-size``, the pool is sized ``n_parallel × N``.
2. llama_context: ``n_ctx`` 0 means the model's training context; it is padded up to a
   multiple of 256. With a unified cache every sequence may use all of it
   (``n_ctx_seq = n_ctx``); otherwise each gets ``pad256(n_ctx / n_seq)`` and ``n_ctx``
   becomes ``n_ctx_seq × n_seq``.
3. llama-server caps a slot at ``--kv-unified-per-slot`` and at the training context.

:func:`attention_rotation` — whether llama.cpp rotates K/V (Hadamard) before storing them.
The stored bytes look the same either way, so a KV state restored across engines that
disagree "works" and gives wrong output: the setting has to be reported and compared.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from codec.seqstate import KV_TYPE_BLOCKS

PAD = 256
AUTO_PARALLEL = 4


def _pad(n: int) -> int:
    return (n + PAD - 1) // PAD * PAD


@dataclass(frozen=True)
class SlotContext:
    n_parallel: int  # slots = n_seq_max
    kv_unified: bool
    n_ctx: int  # KV cells of the context (what llama_n_ctx reports)
    n_ctx_seq: int  # cells one sequence may use (llama_n_ctx_seq)
    n_ctx_slot: int  # llama-server's per-slot limit


def slot_context(
    ctx_size: int | None,
    n_parallel: int,
    kv_unified: bool,
    *,
    n_ctx_train: int,
    kv_unified_per_slot: int = 0,
) -> SlotContext:
    """Per-slot context for ``--ctx-size`` (None: not given, 0: the model's), ``--parallel``
    (-1: auto), ``--kv-unified`` and ``--kv-unified-per-slot``, for a model trained on
    ``n_ctx_train`` tokens."""
    if n_parallel == 0 or n_parallel < -1:
        raise ValueError(f"invalid value for n_parallel: {n_parallel}")
    if n_parallel == -1:
        n_parallel, kv_unified = AUTO_PARALLEL, True
    n_ctx = ctx_size or 0
    if ctx_size is None and kv_unified_per_slot > 0:  # an explicit -c 0 keeps the model's context
        n_ctx = n_parallel * kv_unified_per_slot
    n_ctx = _pad(n_ctx or n_ctx_train)
    if kv_unified:
        n_ctx_seq = n_ctx
    else:
        n_ctx_seq = _pad(n_ctx // n_parallel)
        if n_ctx_seq == 0:
            raise ValueError("n_ctx_seq == 0")
        n_ctx = n_ctx_seq * n_parallel
    n_ctx_slot = min(n_ctx_seq, kv_unified_per_slot) if kv_unified_per_slot > 0 else n_ctx_seq
    return SlotContext(n_parallel, kv_unified, n_ctx, n_ctx_seq, min(n_ctx_slot, n_ctx_train))


def attention_rotation(type_k: str, type_v: str, head_dim_k: int, head_dim_v: int,
                       environ: Mapping[str, str]) -> tuple[bool, bool]:
    """(rotate K, rotate V) for a plain attention model, as llama_kv_cache decides it: on for a
    quantized cache type when the head dimension is a multiple of 64, unless the
    ``LLAMA_ATTN_ROT_DISABLE`` variable (C ``atoi``) is non-zero."""
    disabled = _atoi(environ.get("LLAMA_ATTN_ROT_DISABLE", "0")) != 0

    def rot(type_name: str, head_dim: int) -> bool:
        return not disabled and head_dim > 0 and KV_TYPE_BLOCKS[type_name][0] > 1 and head_dim % 64 == 0

    return rot(type_k, head_dim_k), rot(type_v, head_dim_v)


def _atoi(text: str) -> int:
    m = re.match(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", text)
    return int(m.group(1)) if m else 0


def available_memory() -> int:
    """Bytes the kernel says a new allocation can take without swapping (MemAvailable)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
