"""Capture llama.cpp's log lines in a test, then put the previous log callback back."""
from __future__ import annotations

import ctypes

import llama_cpp as L


class LlamaLogCapture:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self._cb = L.llama_log_callback(lambda level, text, user: self.lines.append(text.decode(errors="replace")))

    def __enter__(self) -> "LlamaLogCapture":
        self._prev_cb, self._prev_data = L.llama_log_callback(), ctypes.c_void_p()
        L.llama_log_get(ctypes.byref(self._prev_cb), ctypes.byref(self._prev_data))
        L.llama_log_set(self._cb, ctypes.c_void_p())
        return self

    def __exit__(self, *exc: object) -> None:
        L.llama_log_set(self._prev_cb, self._prev_data)
