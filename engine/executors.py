"""The engine's two worker threads: inference (every llama.cpp call of the live model) and
loader (building shadow models). Both run at nice 19 by default, so the event loop (nice 0)
preempts them and a shadow load never outranks live generation.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading


def _lower_thread_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (PermissionError, OSError, AttributeError):
        pass


def _single_thread(name: str, low_priority: bool) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=name, initializer=_lower_thread_priority if low_priority else None)


def make_loader_executor(low_priority: bool = True) -> concurrent.futures.ThreadPoolExecutor:
    """A single-thread executor for building (shadow) models."""
    return _single_thread("hydra-loader", low_priority)


def make_inference_executor(low_priority: bool = True) -> concurrent.futures.ThreadPoolExecutor:
    """A single-thread executor for all model calls of one engine.

    With ``low_priority`` the worker thread runs at nice 19 (Linux per-thread nice), so the
    event loop stays responsive while ggml's compute threads, which inherit the nice value
    when started from this thread, use every core.
    """
    return _single_thread("hydra-inference", low_priority)
