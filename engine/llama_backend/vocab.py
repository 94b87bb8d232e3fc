"""Text ↔ tokens through a model's ``llama_vocab`` (buffers grown to what llama.cpp asks for)."""
from __future__ import annotations

import ctypes
from typing import Any, Sequence

import llama_cpp.llama_cpp as L

from .runtime import LlamaBackendError


def tokenize(vocab: Any, text: str | bytes, add_special: bool, parse_special: bool) -> list[int]:
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    n_max = len(data) + 8
    while True:
        buf = (L.llama_token * n_max)()
        n = L.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n >= 0:
            return list(buf[:n])
        if -n <= n_max:  # pragma: no cover - defensive
            raise LlamaBackendError(f"llama_tokenize failed ({n})")
        n_max = -n


def token_to_piece(vocab: Any, tok: int, special: bool) -> bytes:
    size = 32
    while True:
        buf = ctypes.create_string_buffer(size)
        n = L.llama_token_to_piece(vocab, int(tok), buf, size, 0, special)
        if n >= 0:
            return buf.raw[:n]
        size = -n


def detokenize(vocab: Any, tokens: Sequence[int], special: bool) -> bytes:
    if not tokens:
        return b""
    arr = (L.llama_token * len(tokens))(*tokens)
    size = max(64, len(tokens) * 8)
    while True:
        buf = ctypes.create_string_buffer(size)
        n = L.llama_detokenize(vocab, arr, len(tokens), buf, size, False, special)
        if n >= 0:
            return buf.raw[:n]
        size = -n
