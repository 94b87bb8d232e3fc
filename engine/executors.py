"""The engine's two worker threads: inference (every llama.cpp call of the live model) and
loader (building shadow models). Both run at nice 19 by default, so the event loop (nice 0)
preempts them and a shadow load never outranks live generation. llama.cpp's priority levels
(``--prio``, ``--prio-batch``) map onto nice values as llama.cpp's ``set_process_priority``
maps them.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading

log = logging.getLogger("engine.executors")

LOW_NICE = 19
#: llama.cpp's ggml_sched_priority (low, normal, medium, high, realtime) → nice
PRIO_NICE = {-1: 5, 0: 0, 1: -5, 2: -10, 3: -20}


def set_thread_nice(nice: int) -> str | None:
    """Set the calling thread's nice value (threads it starts inherit it); the error, or None."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (PermissionError, OSError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _init_thread(nice: int) -> None:
    error = set_thread_nice(nice)
    if error:  # raising priority needs CAP_SYS_NICE; llama.cpp warns and goes on too
        log.warning("failed to set the priority of thread %s to nice %d: %s", threading.current_thread().name,
                    nice, error)


def _single_thread(name: str, nice: int | None) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=name, initializer=None if nice is None else _init_thread,
        initargs=() if nice is None else (nice,))


def make_loader_executor(low_priority: bool = True, nice: int | None = None) -> concurrent.futures.ThreadPoolExecutor:
    """A single-thread executor for building (shadow) models."""
    return _single_thread("hydra-loader", nice if nice is not None else LOW_NICE if low_priority else None)


def make_inference_executor(low_priority: bool = True,
                            nice: int | None = None) -> concurrent.futures.ThreadPoolExecutor:
    """A single-thread executor for all model calls of one engine.

    With ``low_priority`` the worker thread runs at nice 19 (Linux per-thread nice), so the
    event loop stays responsive while ggml's compute threads, which inherit the nice value
    when started from this thread, use every core. ``nice`` sets another value instead.
    """
    return _single_thread("hydra-inference", nice if nice is not None else LOW_NICE if low_priority else None)
