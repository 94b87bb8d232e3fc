"""``model_hash``: the identity of a loaded model file, SHA-256 over the whole GGUF (hex).

A coordinator stores it with a KV blob (PREFILL meta) and compares it with a slot's before
restoring there (STATE_META), so a KV state never lands silently in another model. Reading a
multi-GiB file takes seconds, so the hash is computed on the loader thread (never the event
loop) and remembered by (real path, size, mtime): in memory, so a reload of the same file
costs nothing, and in a small JSON file beside the model cache, so a restart costs nothing
either. A file that changes gets a new mtime, hence a new hash.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from pathlib import Path

CACHE_FILE = "model-hashes.json"
MAX_ENTRIES = 256  # the cache file keeps the newest entries only

_memo: dict[str, str] = {}
_lock = threading.Lock()


def model_hash(path: str | os.PathLike, cache_dir: Path | None = None) -> str:
    """The SHA-256 of the file at ``path``, from a cache when the file did not change."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = f"{real}|{st.st_size}|{st.st_mtime_ns}"
    with _lock:
        if key in _memo:
            return _memo[key]
    cache = (cache_dir if cache_dir is not None else _default_dir()) / CACHE_FILE
    digest = _load(cache).get(key)
    if not isinstance(digest, str):
        with open(real, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        _save(cache, key, digest)
    with _lock:
        _memo[key] = digest
    return digest


def _default_dir() -> Path:
    from .model_files import default_cache_dir

    return default_cache_dir()


def _load(cache: Path) -> dict:
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save(cache: Path, key: str, digest: str) -> None:
    """Best effort: a cache that cannot be written only costs the next start a re-hash."""
    with _lock:
        entries = _load(cache)
        entries.pop(key, None)
        entries[key] = digest
        entries = dict(list(entries.items())[-MAX_ENTRIES:])
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(entries, indent=0))
            os.replace(tmp, cache)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
