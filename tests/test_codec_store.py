"""Store payloads (docs/protocol.md §13): chunk records, manifests, lists; limits; struct ≡ construct."""
from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codec.errors import CodecError, FrameTooLarge, LocalProtocolError, MalformedPayload, Truncated
from codec.store import (
    Manifest,
    ManifestChunk,
    encode_indexed_chunk,
    encode_list_payload,
    encode_manifest,
    encode_sized_chunk,
    iter_indexed_chunks,
    iter_sized_chunks,
    parse_chunks_construct,
    parse_hash_list,
    parse_list_payload,
    parse_manifest,
    parse_missing_hashes,
    parse_put_meta,
)
from tests.helpers import outcome

BIG = 2**31  # no limit: compare with the construct path, which has none
records = st.lists(st.tuples(st.integers(0, 2**31 - 1), st.binary(max_size=20)), max_size=6)


def indexed_list(payload: bytes, **kw):
    return [(c.index, bytes(c.body)) for c in iter_indexed_chunks(payload, **kw)]


def sized_list(payload: bytes, **kw):
    return [(c.index, bytes(c.body)) for c in iter_sized_chunks(payload, **kw)]


@st.composite
def chunk_payloads(draw: st.DrawFn) -> bytes:
    """Valid record streams, sometimes cut or with one byte changed."""
    indexed = draw(st.booleans())
    recs = draw(records)
    data = bytearray(b"".join(encode_indexed_chunk(i, b) if indexed else encode_sized_chunk(b) for i, b in recs))
    if data and draw(st.booleans()):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        del data[draw(st.integers(0, len(data))) :]
    return bytes(data)


garbage = st.binary(max_size=60) | chunk_payloads()


# ---- chunk records ---------------------------------------------------------------------------


def test_golden_records() -> None:
    assert encode_indexed_chunk(2, b"ab") == b"\x02\x00\x00\x00\x02\x00\x00\x00ab"
    assert encode_sized_chunk(b"xyz") == b"\x03\x00\x00\x00xyz"


@given(records)
def test_indexed_round_trip(recs: list[tuple[int, bytes]]) -> None:
    payload = b"".join(encode_indexed_chunk(i, b) for i, b in recs)
    assert indexed_list(payload) == recs
    offsets = [c.offset for c in iter_indexed_chunks(payload)]
    assert all(payload[o : o + len(b)] == b for o, (_, b) in zip(offsets, recs))


@given(st.lists(st.binary(max_size=20), max_size=6))
def test_sized_round_trip(bodies: list[bytes]) -> None:
    payload = b"".join(map(encode_sized_chunk, bodies))
    assert sized_list(payload) == [(None, b) for b in bodies]


def test_bodies_are_views_not_copies() -> None:
    payload = bytearray(encode_sized_chunk(b"abc"))
    (chunk,) = iter_sized_chunks(payload)
    assert isinstance(chunk.body, memoryview) and chunk.body.obj is payload


@pytest.mark.parametrize(
    ("payload", "kw", "exc", "rule"),
    [
        (struct.pack("<ii", 0, -1), {}, MalformedPayload, "store.chunk_size"),
        (struct.pack("<ii", -1, 0), {}, MalformedPayload, "store.chunk_index"),
        (struct.pack("<ii", 0, 2**31 - 1) + b"x", {}, FrameTooLarge, "store.chunk_size"),
        (struct.pack("<ii", 0, 5) + b"abc", {}, Truncated, "store.chunk_body"),
        (encode_indexed_chunk(0, b"") + b"\x00\x00", {}, Truncated, "store.chunk_header"),
        (encode_indexed_chunk(0, b"") * 3, {"max_chunks": 2}, FrameTooLarge, "store.chunk_count"),
        (encode_indexed_chunk(0, b"abcde"), {"max_chunk": 4}, FrameTooLarge, "store.chunk_size"),
    ],
)
def test_record_limits(payload: bytes, kw: dict, exc: type, rule: str) -> None:
    with pytest.raises(exc) as e:
        indexed_list(payload, **kw)
    assert e.value.rule == rule


def test_records_before_an_error_are_still_yielded() -> None:
    it = iter_sized_chunks(encode_sized_chunk(b"ok") + b"\x09\x00\x00\x00")
    assert bytes(next(it).body) == b"ok"
    with pytest.raises(Truncated):
        next(it)


def test_encoder_rejects() -> None:
    with pytest.raises(LocalProtocolError):
        encode_indexed_chunk(-1, b"")


@settings(max_examples=300)
@given(garbage)
def test_struct_path_equals_construct_path(payload: bytes) -> None:
    assert outcome(indexed_list, payload, max_chunk=BIG) == outcome(parse_chunks_construct, payload, indexed=True)
    assert outcome(sized_list, payload, max_chunk=BIG) == outcome(parse_chunks_construct, payload, indexed=False)


# ---- JSON shapes -----------------------------------------------------------------------------

SHA = "ab" * 32


def test_manifest_round_trip() -> None:
    m = Manifest(42, 10, (ManifestChunk(0, SHA, 6), ManifestChunk(1, SHA, 4)), "alias", None, "/m.gguf", {"x": 1})
    assert parse_manifest(encode_manifest(m)) == m
    raw = {"n_past": 1, "total_size": 2, "chunks": [{"index": 0, "hash": SHA, "size": 2}]}
    assert parse_manifest(json.dumps(raw).encode()).chunks == (ManifestChunk(0, SHA, 2),)
    assert parse_manifest(b'{"n_past":null}') == Manifest(None, None, ())


@pytest.mark.parametrize(
    ("payload", "rule"),
    [
        (b"", "manifest.empty"),
        (b"[]", "manifest.json"),
        (b'{"n_past":-1}', "manifest.n_past"),
        (b'{"total_size":"1"}', "manifest.total_size"),
        (b'{"model_alias":1}', "manifest.model"),
        (b'{"chunks":{}}', "manifest.chunks"),
        (b'{"chunks":[{"index":0,"hash":1,"size":1}]}', "manifest.chunk"),
        (b'{"chunks":[{"index":0,"hash":"h"}]}', "manifest.chunk"),
        (b'{"chunks":[1]}', "manifest.chunk"),
    ],
)
def test_manifest_rules(payload: bytes, rule: str) -> None:
    with pytest.raises(MalformedPayload) as e:
        parse_manifest(payload)
    assert e.value.rule == rule


def test_lists_and_hashes() -> None:
    names = ["a.kv", "kv/é"]
    assert parse_list_payload(encode_list_payload(names)) == names
    assert parse_hash_list(b"") == [] and parse_hash_list(b'["h"]') == ["h"]
    assert parse_missing_hashes(b'{"missing_hashes":["a"]}') == ["a"]
    assert parse_put_meta(b'{"n_past":7}') == 7 and parse_put_meta(b"{}") is None
    for fn, bad, rule in (
        (parse_list_payload, b"", "store.list"),
        (parse_list_payload, b"[1]", "store.list"),
        (parse_hash_list, b'{"a":1}', "store.hashes"),
        (parse_missing_hashes, b'{"missing_hashes":"a"}', "store.missing_hashes"),
        (parse_put_meta, b"", "store.put_meta_empty"),
        (parse_put_meta, b'{"n_past":"x"}', "store.put_meta"),
    ):
        with pytest.raises(MalformedPayload) as e:
            fn(bad)
        assert e.value.rule == rule


@settings(max_examples=200)
@given(garbage)
def test_garbage_only_raises_codec_errors(payload: bytes) -> None:
    for fn in (parse_manifest, parse_list_payload, parse_hash_list, parse_missing_hashes, parse_put_meta,
               lambda p: indexed_list(p, max_chunks=3), sized_list):
        try:
            fn(payload)
        except CodecError:
            pass
