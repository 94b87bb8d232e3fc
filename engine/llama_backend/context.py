"""The two llama.cpp handles a :class:`LoadedModel` owns: the model, loaded from its file, and
one context of ``n_seq_max`` sequences on it. A failure says why, from what llama.cpp logged
(a NULL handle alone says nothing)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import llama_cpp.llama_cpp as L

from ..model_params import decode_capacity
from .runtime import LlamaBackendError, clear_llama_errors, ensure_backend, last_llama_errors


def set_fields(params: Any, extra: dict[str, Any] | None, struct_name: str) -> None:
    names = {f[0] for f in type(params)._fields_}
    for k, v in (extra or {}).items():
        if k not in names:
            raise ValueError(f"unknown {struct_name} field {k!r}")
        setattr(params, k, v)


def _report(progress: Callable[[float], None], share: float) -> bool:
    """llama.cpp's progress callback: never abort the load, and never let an exception into C."""
    try:
        progress(float(share))
    except Exception:  # pragma: no cover - a reporting bug must not fail the load
        pass
    return True


def load_model_file(path: Path, n_gpu_layers: int, extra_model_params: dict[str, Any] | None,
                    progress: Callable[[float], None] | None) -> Any:
    """``llama_model_load_from_file`` with ``extra_model_params`` over llama.cpp's defaults;
    ``progress`` gets the share loaded (0..1). Returns the model handle (free it)."""
    ensure_backend()
    mparams = L.llama_model_default_params()
    mparams.n_gpu_layers = int(n_gpu_layers)
    set_fields(mparams, extra_model_params, "llama_model_params")
    if progress is not None:
        callback = L.llama_progress_callback(lambda share, _user: _report(progress, share))
        mparams.progress_callback = callback  # referenced until the load returns
    clear_llama_errors()
    model = L.llama_model_load_from_file(os.fsencode(path), mparams)
    if not model:
        raise LlamaBackendError(f"failed to load model {path}: {'; '.join(last_llama_errors()) or 'unknown error'}")
    return model


def context_params(*, n_ctx: int, n_seq_max: int, n_batch: int, n_threads: int, n_threads_batch: int | None,
                   kv_unified: bool, extra: dict[str, Any] | None) -> Any:
    """``llama_context_params``: llama.cpp's defaults, these sizes and threads, then ``extra``
    (which may set any field, these too)."""
    cparams = L.llama_context_default_params()
    cparams.n_ctx = int(n_ctx)
    cparams.n_batch = int(n_batch)
    cparams.n_ubatch = min(int(n_batch), 512)
    cparams.n_seq_max = int(n_seq_max)
    cparams.n_threads = n_threads
    cparams.n_threads_batch = int(n_threads_batch) if n_threads_batch and n_threads_batch > 0 else n_threads
    cparams.kv_unified = bool(kv_unified)
    # a decode asks for one logits row per sequence at most (LlamaBatch.fill), so the context
    # reserves that many outputs, as llama-server does (server_output_limits); llama.cpp's
    # default of n_batch sizes the compute buffer for a whole ubatch of logits rows: n_ubatch
    # times the vocabulary in floats, ~500 MiB on a 256K vocabulary, never used
    cparams.n_outputs_max = int(n_seq_max)
    cparams.n_outputs_max_per_seq = 1
    cparams.no_perf = True
    set_fields(cparams, extra, "llama_context_params")
    return cparams


def create_context(model: Any, cparams: Any, path: Path) -> Any:
    """``llama_init_from_model``: the context handle (free it)."""
    # llama.cpp reserves an output row per sequence within the batch, and aborts the process
    # (GGML_ASSERT in output_reserve) when they do not fit: llama-server dies the same way
    n_batch = decode_capacity(cparams.n_ctx, cparams.n_batch)
    if n_batch < cparams.n_seq_max:
        given = "--batch-size" if n_batch == cparams.n_batch else "--ctx-size"
        raise LlamaBackendError(f"a batch of {n_batch} tokens ({given}) cannot hold a token of each of the "
                                f"{cparams.n_seq_max} slots (--parallel): give {given} >= {cparams.n_seq_max}")
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        raise LlamaBackendError(
            f"failed to create a context for {path}: {'; '.join(last_llama_errors()) or 'unknown error'}"
        )
    return ctx


MIN_CTX_SLOT = 2  # a prompt's token and the one generated after it


def slot_context_size(ctx: Any, model: Any, cap: int) -> int:
    """What one slot may hold: llama-server's ``n_ctx_slot()``, under ``--kv-unified-per-slot``
    (``cap``, 0: none) and the model's training context. Refused below ``MIN_CTX_SLOT``."""
    n_seq, n_train, cap = int(L.llama_n_ctx_seq(ctx)), int(L.llama_model_n_ctx_train(model)), int(cap)
    n_slot = min(n_seq, cap, n_train) if cap > 0 else min(n_seq, n_train)
    if n_slot < MIN_CTX_SLOT:
        # llama.cpp scales the training context by the RoPE settings (YaRN's n_ctx_orig /
        # rope_freq_scale): an extreme --rope-scale leaves it at 0, every prompt would be
        # refused, and llama-server aborts on its first request
        raise LlamaBackendError(
            f"a slot would hold {n_slot} tokens (llama.cpp's n_ctx_seq {n_seq}, the model's training context "
            f"{n_train} after RoPE scaling" + (f", --kv-unified-per-slot {cap}" if cap > 0 else "")
            + "): check --rope-scale / --rope-freq-scale and --ctx-size")
    return n_slot
