"""Process-wide llama.cpp state: backend init, the log ring, RPC support, our error types.

llama.cpp logs through one callback per process. We keep it silent by default but remember
the last warnings and errors, which turn an opaque failure (a NULL model, a decode that
returns 1) into an error message that says why. With the ``engine`` loggers at DEBUG (``-v``,
``-lv 4`` and up, ``--log-level DEBUG``) every line goes to ``engine.llama_cpp`` too, as
llama-server shows llama.cpp's lines when verbose: through the server's formatter, escaped
(a grammar's parse error quotes the client's grammar).
"""
from __future__ import annotations

import collections
import ctypes
import logging
import os
import sys
import threading
from typing import Callable, Sequence

import llama_cpp.llama_cpp as L

from ..backend import BatchItem
from ..jobs import KvCacheFull


class LlamaBackendError(RuntimeError):
    """Base class of the llama backend's errors."""


class DecodeError(LlamaBackendError):
    """``llama_decode`` returned non-zero.

    ``code``: 1 = no KV slot (context full), 2 = aborted, -1 = invalid batch, < -1 fatal.
    After a failed decode no logits are available (:meth:`LoadedModel.logits` raises).
    """

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class ContextExceeded(DecodeError, KvCacheFull):
    """Code 1: the KV cache has no cell left for the batch."""


class StateError(LlamaBackendError):
    """Restoring a sequence state failed."""


# --------------------------------------------------------------------------------------
# logging: silent by default, but keep the last warnings/errors for error messages
# --------------------------------------------------------------------------------------
_GGML_LOG_WARN, _GGML_LOG_ERROR, _GGML_LOG_CONT = 3, 4, 5  # ggml.h enum ggml_log_level
_recent_errors: collections.deque[str] = collections.deque(maxlen=16)
_log_state = {"verbose": False, "last_level": 0}
llama_log = logging.getLogger("engine.llama_cpp")
_partial = threading.local()  # per thread: a line llama.cpp writes in pieces, until its newline
_LONGEST_LINE = 4096


def _log_cb_impl(level: int, text: bytes | None, _user: ctypes.c_void_p) -> None:
    try:
        if level != _GGML_LOG_CONT:
            _log_state["last_level"] = level
        eff = _log_state["last_level"]
        s = text.decode("utf-8", "replace") if text else ""
        if eff in (_GGML_LOG_WARN, _GGML_LOG_ERROR) and s.strip():
            _recent_errors.append(s.rstrip("\n"))
        if _log_state["verbose"]:
            sys.stderr.write(s)
            sys.stderr.flush()
        if llama_log.isEnabledFor(logging.DEBUG):
            _forward(s, level == _GGML_LOG_CONT)
    except Exception:  # never raise into C
        pass


def _forward(text: str, cont: bool) -> None:
    """llama.cpp's text to ``engine.llama_cpp``, a record per complete line; a piece that is not
    a continuation starts a new line (the load's progress dots end without one)."""
    before = getattr(_partial, "text", "")
    if before and not cont:
        llama_log.debug("%s", before)
        before = ""
    *lines, rest = (before + text).split("\n")
    if len(rest) > _LONGEST_LINE:  # a line that never ends still goes out, in records this long
        lines, rest = lines + [rest], ""
    _partial.text = rest
    for line in lines:
        if line.strip():
            llama_log.debug("%s", line)


# keep a module-level reference: llama.cpp stores the raw function pointer
_LOG_CALLBACK = L.llama_log_callback(_log_cb_impl)
L.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def set_llama_logging(verbose: bool) -> None:
    """Write llama.cpp/ggml log lines to stderr (True) or drop them (False, the default).

    Warnings and errors are always kept in a small ring buffer (:func:`last_llama_errors`).
    """
    _log_state["verbose"] = bool(verbose)


def last_llama_errors(n: int = 4) -> list[str]:
    """The last ``n`` warning/error lines llama.cpp logged (for error messages)."""
    return list(_recent_errors)[-n:]



def clear_llama_errors() -> None:
    """Forget earlier lines, so the next failure reports only its own."""
    _recent_errors.clear()


def decode_error_message(rc: int, items: Sequence[BatchItem], pos_max: Callable[[int], int]) -> str:
    """What a failed ``llama_decode`` of ``items`` says: the code, the batch's first sequences
    (``pos_max``: where each one's cache ends) and llama.cpp's last complaints."""
    what = {1: "Context size has been exceeded: no KV cell left for the batch", 2: "aborted",
            -1: "invalid batch"}.get(rc, "fatal error")
    detail = ", ".join(f"seq {it.seq}: {len(it.tokens)} tok at pos {it.pos0} (cache pos_max {pos_max(it.seq)})"
                       for it in items[:8])
    logs = "; ".join(last_llama_errors(3))
    return f"llama_decode failed with {rc} ({what}); {detail}" + (f"; llama.cpp: {logs}" if logs else "")


def check_rpc_support() -> None:
    """Raise RuntimeError unless llama-cpp-python was built with ``-DGGML_RPC=ON``."""
    if not L.llama_supports_rpc():
        raise RuntimeError(
            "llama-cpp-python was built without ggml RPC support: reinstall it with "
            "CMAKE_ARGS='-DGGML_RPC=ON -DGGML_NATIVE=OFF' (see scripts/install_llama_cpp.sh; "
            "pass --no-cache-dir, pip's wheel cache ignores CMAKE_ARGS)"
        )


_backend_lock = threading.Lock()
_backend_initialized = False


def ensure_backend() -> None:
    global _backend_initialized
    with _backend_lock:
        if not _backend_initialized:
            L.llama_backend_init()
            _backend_initialized = True


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)

