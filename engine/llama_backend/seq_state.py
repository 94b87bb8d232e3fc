"""A sequence's state in and out of a llama.cpp context: the bytes STATE_GET / STATE_PUT, slot
files, the prompt cache and context checkpoints move (``LoadedModel.state_seq_*``,
``checkpoint_*``; the format is in codec/seqstate.py).

States run to hundreds of MiB, so every byte is written once, into the buffer that is handed
on, and read in place: the ctypes calls here never make a second copy.
"""
from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp.llama_cpp as L

from ..buffers import Buffer, lazy_buffer, release_tail
from .runtime import StateError, clear_llama_errors, last_llama_errors

_PARTIAL = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


def size(ctx: Any, seq: int) -> int:
    return int(L.llama_state_seq_get_size(ctx, seq))


def get(ctx: Any, seq: int) -> memoryview:
    """A read-only view of the one buffer llama.cpp wrote ``seq``'s state into: a
    :func:`engine.buffers.lazy_buffer`, whose pages the copy faults in with the GIL released (a
    zeroed ctypes array of the fleet model's state held it ~22 ms)."""
    buf = lazy_buffer(max(int(L.llama_state_seq_get_size(ctx, seq)), 1))
    return memoryview(buf)[:get_into(ctx, seq, buf)].toreadonly()


def get_into(ctx: Any, seq: int, buf: Buffer | memoryview) -> int:
    mv = memoryview(buf).cast("B")
    dst = (ctypes.c_uint8 * len(mv)).from_buffer(mv)
    return int(L.llama_state_seq_get_data(ctx, dst, len(mv), seq))


def get_partial(ctx: Any, seq: int, reuse: Buffer | None = None) -> Buffer | memoryview:
    """``seq``'s ``PARTIAL_ONLY`` state (what a context checkpoint keeps), written by llama.cpp
    into the buffer that is kept: ``reuse`` when it is large enough (a dropped checkpoint's), else
    a new one. A large hybrid's recurrent state is tens of MiB, taken with every prompt, and most
    of a new buffer's cost is the kernel handing out its pages (docs/performance.md): a new one
    is a :func:`engine.buffers.lazy_buffer`, whose pages llama.cpp's copy faults in with the GIL
    released, so the event loop goes on answering meanwhile."""
    n_max = int(L.llama_state_seq_get_size_ext(ctx, seq, _PARTIAL))
    out = reuse if reuse is not None and len(reuse) >= n_max > 0 else lazy_buffer(max(n_max, 1))
    dst = (ctypes.c_uint8 * len(out)).from_buffer(out)
    n = int(L.llama_state_seq_get_data_ext(ctx, dst, n_max, seq, _PARTIAL))
    del dst  # ends the export: the buffer can be cut to the bytes written
    if isinstance(out, bytearray):
        del out[n:]
        return out
    if n == len(out):
        return out
    release_tail(out, n)  # a mapping is not cut: a view of what was written, the pages past it given back
    return memoryview(out)[:n]


def set_partial(ctx: Any, seq: int, data: bytes | Buffer | memoryview) -> bool:
    src, n_bytes = _source(data)
    clear_llama_errors()
    return n_bytes > 0 and int(L.llama_state_seq_set_data_ext(ctx, src, n_bytes, seq, _PARTIAL)) > 0


def _source(data: bytes | bytearray | memoryview) -> tuple[Any, int]:
    """``data`` as what a ctypes call reads in place, and its length in bytes."""
    # No ctypes.cast of a ctypes object: it links the object and its cast in a reference cycle
    # (each keeps the other in ``_objects``), and the cycle would keep the caller's buffer
    # — hundreds of MiB — alive until the cyclic GC runs. A bytes object is cast by address
    # (kept alive by ``data`` during the call); a c_uint8 array passes as the pointer itself.
    if isinstance(data, bytes):
        return ctypes.cast(data, ctypes.POINTER(ctypes.c_uint8)), len(data)
    mv = memoryview(data).cast("B")
    if mv.readonly:
        mv = memoryview(bytearray(mv))  # rare: a read-only view must be copied once
    return (ctypes.c_uint8 * mv.nbytes).from_buffer(mv), mv.nbytes


def restore(ctx: Any, mem: Any, seq: int, data: bytes | bytearray | memoryview) -> int:
    """Clear ``seq`` and load ``data`` into it, read in place; returns the bytes read. Raises
    :class:`StateError` (``seq`` left empty) when llama.cpp rejects it."""
    L.llama_memory_seq_rm(mem, seq, -1, -1)
    src, n_bytes = _source(data)
    if not n_bytes:
        return 0
    clear_llama_errors()
    n = int(L.llama_state_seq_set_data(ctx, src, n_bytes, seq))
    if n == 0:
        L.llama_memory_seq_rm(mem, seq, -1, -1)
        logs = "; ".join(last_llama_errors(3))
        raise StateError(
            f"llama_state_seq_set_data rejected {n_bytes} bytes for seq {seq}"
            + (f": {logs}" if logs else "")
        )
    return n
