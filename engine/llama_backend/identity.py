"""A loaded model's identity: the names, quantisation and capability bits the wire reports,
read from the GGUF metadata and the llama.cpp model."""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as L

from ..model_hash import model_hash

# model_capabilities bits
CAP_MTP = 1 << 0
CAP_VISION = 1 << 1
CAP_REASONING = 1 << 2
CAP_TOOL_USE = 1 << 3
CAP_CODE = 1 << 4

# LLAMA_FTYPE_* value -> short name ("F32", "Q8_0", "Q4_K_M", ...)
_FTYPE_NAMES: dict[int, str] = {}
for _n in dir(L):
    if _n.startswith("LLAMA_FTYPE_") and _n != "LLAMA_FTYPE_GUESSED":
        _v = getattr(L, _n)
        if isinstance(_v, int):
            _FTYPE_NAMES.setdefault(_v, _n.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_").removeprefix("ALL_"))


def ftype_name(ftype: int) -> str:
    """Name of a ``llama_ftype`` value, e.g. 15 -> "Q4_K_M"."""
    return _FTYPE_NAMES.get(int(ftype) & ~1024, f"FTYPE_{int(ftype)}")


def meta_value(model: Any, key: str) -> str | None:
    """GGUF metadata value as a string (None if absent)."""
    size = 256
    while True:
        buf = ctypes.create_string_buffer(size)
        n = L.llama_model_meta_val_str(model, key.encode(), buf, size)
        if n < 0:
            return None
        if n < size:
            return buf.value.decode("utf-8", "replace")
        size = n + 1


def chat_template_source(model: Any) -> str | None:
    raw = L.llama_model_chat_template(model, None)
    return raw.decode("utf-8", "replace") if raw else None


def capabilities(model: Any, vocab: Any, template: str) -> int:
    caps = 0
    if int(L.llama_model_n_layer_nextn(model)) > 0:
        caps |= CAP_MTP
    if "<think>" in template or "enable_thinking" in template or "reasoning_content" in template:
        caps |= CAP_REASONING
    if "tools" in template or "tool_calls" in template:
        caps |= CAP_TOOL_USE
    if int(L.llama_vocab_fim_pre(vocab)) >= 0 and int(L.llama_vocab_fim_suf(vocab)) >= 0:
        caps |= CAP_CODE  # fill-in-the-middle tokens: a code model
    return caps


def read_identity(model: Any, vocab: Any, path: Path, n_vocab: int) -> dict[str, Any]:
    """model_path, model_name, tokenizer, model_quant, model_capabilities, model_hash
    (engine.model_hash: cached, else read here on the loader thread), n_params, size_bytes
    (file size), plus architecture/n_ctx_train/n_layer/n_embd/tensor_bytes."""
    tok_model = meta_value(model, "tokenizer.ggml.model") or "unknown"
    ft = meta_value(model, "general.file_type")
    quant = ftype_name(int(ft)) if ft is not None and ft.lstrip("-").isdigit() else ftype_name(
        L.llama_model_ftype(model))
    size = path.stat().st_size
    return {
        "model_path": str(path),
        "model_name": meta_value(model, "general.name") or path.stem,
        "tokenizer": f"{tok_model}/{n_vocab}",
        "model_quant": quant,
        "model_capabilities": capabilities(model, vocab, chat_template_source(model) or ""),
        "model_hash": model_hash(path),
        "n_params": int(L.llama_model_n_params(model)),
        "size_bytes": size,
        "tensor_bytes": int(L.llama_model_size(model)),
        "architecture": meta_value(model, "general.architecture") or "",
        "n_ctx_train": int(L.llama_model_n_ctx_train(model)),
        "n_layer": int(L.llama_model_n_layer(model)),
        "n_embd": int(L.llama_model_n_embd(model)),
    }
