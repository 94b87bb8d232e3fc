"""engine.model_hash: SHA-256 of the model file, computed once per (path, size, mtime)."""
from __future__ import annotations

import hashlib
import os

import pytest

from engine import model_hash as mh


def test_the_hash_is_the_files_sha256_and_is_remembered(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(range(256)) * 1000)
    want = hashlib.sha256(model.read_bytes()).hexdigest()
    assert mh.model_hash(model, tmp_path) == want

    def no_reading(*a, **k):
        raise AssertionError("the file was read again")

    monkeypatch.setattr(hashlib, "file_digest", no_reading)
    assert mh.model_hash(model, tmp_path) == want  # in memory
    monkeypatch.setattr(mh, "_memo", {})
    assert mh.model_hash(str(model), tmp_path) == want  # from the cache file (a restart)
    link = tmp_path / "link.gguf"
    link.symlink_to(model)
    assert mh.model_hash(link, tmp_path) == want  # the real path is the key


def test_a_changed_file_is_hashed_again(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"one")
    first = mh.model_hash(model, tmp_path)
    model.write_bytes(b"two")
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a distinct mtime, whatever the fs
    assert mh.model_hash(model, tmp_path) == hashlib.sha256(b"two").hexdigest() != first


def test_an_unwritable_cache_only_costs_a_rehash(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")  # a file where the cache directory should be
    assert mh.model_hash(model, blocker / "sub") == hashlib.sha256(b"x").hexdigest()
    with pytest.raises(FileNotFoundError):
        mh.model_hash(tmp_path / "missing.gguf", tmp_path)
