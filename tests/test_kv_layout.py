"""engine/kv_layout.py: the per-slot context and attention-rotation rules, checked against llama.cpp itself."""
from __future__ import annotations

import os

import llama_cpp as L
import pytest

from engine.model_files import ensure_tiny_model
from engine.kv_layout import slot_context

from tests.llama_log import LlamaLogCapture

TRAIN = 262144


@pytest.mark.parametrize(("args", "want"), [
    # the fleet's RTX node: --ctx-size 320000 --parallel 2 --kv-unified → every slot may use all of it
    ((320000, 2, True), (2, True, 320000, 320000, TRAIN)),
    ((8192, 4, False), (4, False, 8192, 2048, 2048)),
    ((1000, 3, False), (3, False, 1536, 512, 512)),  # pad(1000)=1024, /3 → pad(341)=512
    ((1000, 3, True), (3, True, 1024, 1024, 1024)),
    ((None, 2, False), (2, False, TRAIN, TRAIN // 2, TRAIN // 2)),  # the model's training context
    ((8192, -1, False), (4, True, 8192, 8192, 8192)),  # --parallel auto: 4 unified slots
])
def test_rule(args, want):
    got = slot_context(*args, n_ctx_train=TRAIN)
    assert (got.n_parallel, got.kv_unified, got.n_ctx, got.n_ctx_seq, got.n_ctx_slot) == want


def test_training_context_caps_a_slot():
    assert slot_context(320000, 2, True, n_ctx_train=32768).n_ctx_slot == 32768


def test_kv_unified_per_slot():
    # sizes the pool when --ctx-size is not given, and caps each slot
    got = slot_context(None, 4, True, n_ctx_train=TRAIN, kv_unified_per_slot=4096)
    assert (got.n_ctx, got.n_ctx_seq, got.n_ctx_slot) == (16384, 16384, 4096)
    # an explicit -c 0 keeps the model's context (llama-server disables the auto sizing then)
    got = slot_context(0, 4, True, n_ctx_train=TRAIN, kv_unified_per_slot=4096)
    assert (got.n_ctx, got.n_ctx_slot) == (TRAIN, 4096)


@pytest.mark.parametrize("n_parallel", [0, -2])
def test_invalid_parallel(n_parallel):
    with pytest.raises(ValueError):
        slot_context(4096, n_parallel, True, n_ctx_train=TRAIN)


@pytest.fixture(scope="module")
def tiny_model():
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(ensure_tiny_model()).encode(), L.llama_model_default_params())
    yield model
    L.llama_model_free(model)


@pytest.mark.parametrize(("n_ctx", "n_seq", "unified"), [(1000, 3, False), (1000, 3, True), (4096, 4, False),
                                                         (0, 2, False), (300, 1, False), (2049, 2, True)])
def test_agrees_with_llama_cpp(tiny_model, n_ctx, n_seq, unified):
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max, cp.kv_unified, cp.n_batch, cp.n_ubatch = n_ctx, n_seq, unified, 64, 64
    cp.n_threads = cp.n_threads_batch = 1
    ctx = L.llama_init_from_model(tiny_model, cp)
    assert ctx
    try:
        want = slot_context(n_ctx, n_seq, unified, n_ctx_train=L.llama_model_n_ctx_train(tiny_model))
        assert (L.llama_n_ctx(ctx), L.llama_n_ctx_seq(ctx)) == (want.n_ctx, want.n_ctx_seq)
    finally:
        L.llama_free(ctx)


# ---- attention rotation ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def head64_model(tmp_path_factory):
    from engine.model_files import TinyModelParams, write_tiny_gguf

    path = write_tiny_gguf(tmp_path_factory.mktemp("m") / "hd64.gguf",
                           TinyModelParams(n_embd=128, n_head=2, n_head_kv=1, name="hydra-tiny-hd64"))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    yield model
    L.llama_model_free(model)


@pytest.mark.parametrize(("type_k", "type_v", "env"), [
    ("q8_0", "q8_0", None), ("q8_0", "q8_0", "1"), ("q8_0", "q8_0", "0"), ("f16", "f16", None),
    ("q4_0", "f16", None), ("iq4_nl", "q5_1", " 2x"), ("bf16", "q8_0", "abc"),
])
def test_attention_rotation_agrees_with_llama_cpp(head64_model, monkeypatch, type_k, type_v, env):
    from codec.seqstate import GGML_TYPE_IDS
    from engine.kv_layout import attention_rotation

    if env is None:
        monkeypatch.delenv("LLAMA_ATTN_ROT_DISABLE", raising=False)
    else:
        monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", env)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.flash_attn_type = 256, 32, 32, L.LLAMA_FLASH_ATTN_TYPE_ENABLED
    cp.type_k, cp.type_v = GGML_TYPE_IDS[type_k], GGML_TYPE_IDS[type_v]
    with LlamaLogCapture() as log:
        ctx = L.llama_init_from_model(head64_model, cp)
    assert ctx
    L.llama_free(ctx)
    logged = tuple(next(ln.split("= ")[1].split(",")[0] == "1" for ln in log.lines if f"attn_rot_{x} =" in ln)
                   for x in "kv")
    head_dim = 128 // 2
    assert attention_rotation(type_k, type_v, head_dim, head_dim, dict(os.environ)) == logged


def test_attention_rotation_needs_head_dim_multiple_of_64():
    from engine.kv_layout import attention_rotation

    assert attention_rotation("q8_0", "q8_0", 32, 32, {}) == (False, False)
    assert attention_rotation("q8_0", "f32", 128, 128, {}) == (True, False)
