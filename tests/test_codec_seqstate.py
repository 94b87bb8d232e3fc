"""llama.cpp sequence-state header: real blobs from llama-cpp-python, limits, struct ≡ construct.

The blobs come from real contexts of the generated tiny models with different cache types,
flash attention on/off, kv_unified on/off and sequence counts; ``compare`` must agree with
what llama.cpp itself does when the blob is restored into another context.
"""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass, replace

import llama_cpp as L
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codec.errors import CodecError, MalformedPayload, Truncated
from codec.seqstate import (
    GGML_TYPE_IDS,
    SEQ_STATE,
    SEQ_STATE_MAGIC,
    KvExpected,
    compare,
    ggml_type_name,
    kv_row_size,
    parse_seq_state,
)
from engine.model_files import VARIANTS, ensure_tiny_model

FA_ON, FA_OFF = L.LLAMA_FLASH_ATTN_TYPE_ENABLED, L.LLAMA_FLASH_ATTN_TYPE_DISABLED
N_CTX = 512


@dataclass(frozen=True)
class Cfg:
    variant: str = "a"  # "a": head dim 16 (f16/f32/bf16 only); "b": head dim 32 (quantized too)
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    kv_unified: bool = True
    n_seq: int = 2

    @property
    def n_stream(self) -> int:
        return 1 if self.kv_unified else self.n_seq

    def expected(self) -> KvExpected:
        p = VARIANTS[self.variant]
        n_embd_gqa = p.n_embd // p.n_head * p.n_head_kv
        return KvExpected(self.n_stream, not self.flash_attn, self.type_k, self.type_v,
                          (n_embd_gqa,) * p.n_layer, (n_embd_gqa,) * p.n_layer, N_CTX)


CONFIGS = [
    Cfg(),
    Cfg(type_k="f32", type_v="f32"),
    Cfg(flash_attn=True),
    Cfg(kv_unified=False, n_seq=3),
    Cfg("b", "q8_0", "q8_0", flash_attn=True),  # the fleet's settings
    Cfg("b", "iq4_nl", "q4_0", flash_attn=True),
    Cfg("b", "q5_1", "q5_0", flash_attn=True, kv_unified=False, n_seq=4),
    Cfg("b", "bf16", "q4_1", flash_attn=True),
    Cfg("b", "q8_0", "f16"),  # quantized K with V transposed
]


class Engine:
    """One real llama.cpp context per configuration (low-level API, no project code)."""

    def __init__(self) -> None:
        L.llama_backend_init()
        self.models = {}
        self.contexts = {}

    def model(self, variant: str):
        if variant not in self.models:
            path = str(ensure_tiny_model(variant)).encode()
            self.models[variant] = L.llama_model_load_from_file(path, L.llama_model_default_params())
        return self.models[variant]

    def ctx(self, cfg: Cfg):
        if cfg not in self.contexts:
            cp = L.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = N_CTX, 64, 64, cfg.n_seq
            cp.n_threads = cp.n_threads_batch = 1
            cp.type_k, cp.type_v = GGML_TYPE_IDS[cfg.type_k], GGML_TYPE_IDS[cfg.type_v]
            cp.flash_attn_type = FA_ON if cfg.flash_attn else FA_OFF
            cp.kv_unified = cfg.kv_unified
            ctx = L.llama_init_from_model(self.model(cfg.variant), cp)
            assert ctx, f"llama.cpp refused context {cfg}"
            self.contexts[cfg] = ctx
        return self.contexts[cfg]

    def blob(self, cfg: Cfg, seq: int, n_tok: int) -> bytes:
        ctx = self.ctx(cfg)
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        batch = L.llama_batch_init(64, 0, cfg.n_seq)
        try:
            for i in range(n_tok):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = 10 + i, i, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = i == n_tok - 1
            batch.n_tokens = n_tok
            assert L.llama_decode(ctx, batch) == 0
        finally:
            L.llama_batch_free(batch)
        size = L.llama_state_seq_get_size(ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        assert L.llama_state_seq_get_data(ctx, buf, size, seq) == size
        return bytes(buf)

    def restore(self, cfg: Cfg, blob: bytes) -> bool:
        ctx = self.ctx(cfg)
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        src = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        return L.llama_state_seq_set_data(ctx, src, len(blob), 0) != 0

    def close(self) -> None:
        for ctx in self.contexts.values():
            L.llama_free(ctx)
        for m in self.models.values():
            L.llama_model_free(m)


@pytest.fixture(scope="module")
def engine():
    e = Engine()
    yield e
    e.close()


@pytest.fixture(scope="module")
def blobs(engine):
    """Per configuration: a 7-token state of the last sequence."""
    return {cfg: engine.blob(cfg, cfg.n_seq - 1, 7) for cfg in CONFIGS}


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_real_blob_summary(blobs, cfg):
    blob = blobs[cfg]
    s = parse_seq_state(blob, max_cells=N_CTX)
    assert s.size == len(blob) and s.seq_id == cfg.n_seq - 1
    assert s.n_stream == cfg.n_stream
    assert s.cell_count == 7 and (s.pos_min, s.pos_max) == (0, 6)
    assert s.v_trans == int(not cfg.flash_attn)
    assert s.n_layer == VARIANTS[cfg.variant].n_layer
    d = s.as_dict()
    assert (d["type_k"], d["type_v"]) == ([cfg.type_k], [cfg.type_v])
    assert compare(s, cfg.expected()) is None
    # only the sequence's own stream has cells when each sequence has its stream
    assert [st_.cell_count for st_ in s.caches[0].streams] == ([7] if cfg.kv_unified else [0] * (cfg.n_seq - 1) + [7])


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_struct_path_equals_construct(blobs, cfg):
    blob = blobs[cfg]
    s = parse_seq_state(blob, max_cells=N_CTX)
    c = SEQ_STATE.parse(blob)
    assert (c.prefix.seq_id, c.kv.n_stream) == (s.seq_id, s.n_stream)
    for cs, ss in zip(c.kv.streams, s.caches[0].streams, strict=True):
        assert cs.cell_count == ss.cell_count
        if cs.cell_count:
            assert [cell.pos for cell in cs.body.cells] == list(range(7))
            assert cs.body.v_trans == ss.v_trans
            got = [(k.type, k.row_size, v.type, v.row_size if "row_size" in v else v.el_size) for k, v in
                   zip(cs.body.k, cs.body.v)]
            assert got == [(ly.k_type, ly.k_row_size, ly.v_type, ly.v_row_size) for ly in ss.layers]


def test_logits_tail_is_not_part_of_the_state(blobs):
    blob = blobs[CONFIGS[0]]
    s = parse_seq_state(blob + b"\0" * (512 * 4), max_cells=N_CTX)
    assert s.size == len(blob)


def test_compare_agrees_with_llama_cpp_restore(engine, blobs):
    """For every (writer, reader) pair: compare() finds no mismatch iff llama.cpp restores it."""
    for writer in CONFIGS:
        summary = parse_seq_state(blobs[writer], max_cells=N_CTX)
        for reader in CONFIGS:
            if VARIANTS[writer.variant] != VARIANTS[reader.variant]:
                continue  # another model: n_layer/row sizes differ, covered below
            mismatch = compare(summary, reader.expected())
            assert (mismatch is None) == engine.restore(reader, blobs[writer]), (writer, reader, mismatch)


def test_compare_names_the_field_with_type_names(blobs):
    fleet = Cfg("b", "q8_0", "q8_0", flash_attn=True)
    s = parse_seq_state(blobs[Cfg("b", "iq4_nl", "q4_0", flash_attn=True)], max_cells=N_CTX)
    assert compare(s, fleet.expected()) == ("type_k", "iq4_nl", "q8_0")
    s = parse_seq_state(blobs[Cfg("b", "q8_0", "f16")], max_cells=N_CTX)
    assert compare(s, fleet.expected()) == ("v_trans", 1, 0)
    s = parse_seq_state(blobs[Cfg(kv_unified=False, n_seq=3)], max_cells=N_CTX)
    assert compare(s, Cfg().expected()) == ("n_stream", 3, 1)
    s = parse_seq_state(blobs[Cfg()], max_cells=N_CTX)
    assert compare(s, Cfg("b").expected()) == ("n_layer", 2, 3)
    assert compare(s, replace(Cfg().expected(), max_cells=4)) == ("cell_count", 7, 4)
    s = parse_seq_state(blobs[Cfg(type_k="f32", type_v="f32")], max_cells=N_CTX)
    assert compare(s, Cfg(type_v="f32").expected()) == ("type_k", "f32", "f16")


# ---- hostile blobs ----------------------------------------------------------------------------

# Offsets in a unified (1-stream) blob: magic 0, seq_id 4, n_stream 8, cell_count 12, cells
# of 12 bytes from 16, then v_trans and n_layer.
def test_every_truncation_is_refused(blobs):
    blob = blobs[Cfg("b", "q8_0", "q8_0", flash_attn=True)]
    for n in range(len(blob)):
        with pytest.raises(Truncated):
            parse_seq_state(blob[:n], max_cells=N_CTX)


@pytest.mark.parametrize(("offset", "value", "rule"), [
    (0, 0x12345678, "seq.magic"),
    (8, 0, "seq.n_stream"),
    (8, 0xFFFFFFFF, "seq.n_stream"),
    (12, 0xFFFFFFFF, "seq.cells"),
    (12, N_CTX + 1, "seq.cells"),
    (16 + 12 * 6, 1 << 26, "seq.pos"),  # the position bomb: last cell at 2^26
    (16 + 12 * 6, 0x80000000, "seq.pos"),  # negative
    (16 + 12 * 3 + 4, 2, "seq.n_seq_id"),
    (16 + 12 * 7, 2, "seq.v_trans"),
    (16 + 12 * 7 + 4, 0xFFFFFFFF, "seq.n_layer"),
])
def test_claims_are_bounded(blobs, offset, value, rule):
    blob = bytearray(blobs[Cfg()])
    struct.pack_into("<I", blob, offset, value)
    with pytest.raises(CodecError) as e:
        parse_seq_state(blob, max_cells=N_CTX)
    assert e.value.rule == rule


@pytest.mark.parametrize("row", [0, 1 << 40, (1 << 63) - 1, (1 << 64) - 1])
def test_row_size_claims_are_bounded(blobs, row):
    blob = bytearray(blobs[Cfg()])
    k_row_at = 16 + 12 * 7 + 8 + 4  # after v_trans, n_layer and layer 0's k_type
    struct.pack_into("<Q", blob, k_row_at, row)
    with pytest.raises(CodecError) as e:
        parse_seq_state(blob, max_cells=N_CTX)
    assert e.value.rule in ("seq.row_size", "seq.truncated")


def test_caller_limits(blobs):
    blob = blobs[Cfg()]
    with pytest.raises(MalformedPayload) as e:
        parse_seq_state(blob, max_cells=6)
    assert e.value.rule == "seq.cells"
    with pytest.raises(MalformedPayload) as e:
        parse_seq_state(blob, max_cells=N_CTX, max_layers=1)
    assert e.value.rule == "seq.n_layer"
    with pytest.raises(MalformedPayload) as e:
        parse_seq_state(blob, max_cells=N_CTX, max_pos=6)
    assert e.value.rule == "seq.pos"
    with pytest.raises(Truncated):  # a second KV cache (iSWA) that is not there
        parse_seq_state(blob, max_cells=N_CTX, n_caches=2)
    with pytest.raises(CodecError):  # cells read as 24-byte ext records
        parse_seq_state(blob, max_cells=N_CTX, cell_ext=True)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=600))
def test_garbage_after_the_magic_raises_only_codec_errors(data):
    try:
        parse_seq_state(struct.pack("<Ii", SEQ_STATE_MAGIC, 0) + data, max_cells=N_CTX)
    except CodecError:
        pass


# ---- struct path ≡ construct on synthesized layouts ---------------------------------------------

@st.composite
def layouts(draw: st.DrawFn) -> dict:
    n_stream = draw(st.integers(1, 3))
    v_trans = draw(st.integers(0, 1))
    n_layer = draw(st.integers(0, 3))
    streams = []
    for _ in range(n_stream):
        cells = draw(st.integers(0, 4))
        if not cells:
            streams.append({"cell_count": 0, "body": None})
            continue
        k = [{"type": draw(st.sampled_from([0, 1, 8])), "row_size": (rs := draw(st.integers(1, 6))),
              "data": bytes(rs * cells)} for _ in range(n_layer)]
        if v_trans:
            v = [{"type": 1, "el_size": (el := draw(st.integers(1, 4))), "n_embd": (ne := draw(st.integers(1, 3))),
                  "data": bytes(el * ne * cells)} for _ in range(n_layer)]
        else:
            v = [{"type": 8, "row_size": (rs := draw(st.integers(1, 6))), "data": bytes(rs * cells)}
                 for _ in range(n_layer)]
        cell_list = [{"pos": draw(st.integers(0, 100)), "n_seq_id": 1, "seq_ids": [0]} for _ in range(cells)]
        streams.append({"cell_count": cells, "body": {"cells": cell_list, "v_trans": v_trans, "n_layer": n_layer,
                                                      "k": k, "v": v}})
    return {"prefix": {"seq_id": draw(st.integers(-5, 5))}, "kv": {"n_stream": n_stream, "streams": streams}}


@settings(max_examples=200, deadline=None)
@given(layout=layouts())
def test_synthesized_layouts_parse_like_construct(layout):
    blob = SEQ_STATE.build(layout)
    s = parse_seq_state(blob, max_cells=8, max_pos=101)
    assert s.size == len(blob)
    c = SEQ_STATE.parse(blob)
    for cs, ss in zip(c.kv.streams, s.caches[0].streams, strict=True):
        assert cs.cell_count == ss.cell_count
        if cs.cell_count:
            pos = [cell.pos for cell in cs.body.cells]
            assert (ss.pos_min, ss.pos_max) == (min(pos), max(pos))
            assert len(ss.layers) == cs.body.n_layer


def test_type_names_and_row_sizes():
    assert ggml_type_name(8) == "q8_0" and ggml_type_name(20) == "iq4_nl" and ggml_type_name(99) == "ggml_type(99)"
    assert kv_row_size("q8_0", 64) == 68 and kv_row_size("f16", 64) == 128 and kv_row_size("iq4_nl", 32) == 18
