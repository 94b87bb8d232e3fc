"""Dialect detection: one decision per function, shared by the server, the fuzzer and the inspector."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from codec.decode_v3 import encode_decode_v3
from codec.dialects import Dialect, decode_dialect, looks_like_decode_v3_prefix, pin_stream_follows, prefill_dialect
from codec.enums import Status
from codec.framing import ResponseHeader
from codec.payloads import encode_e1_decode, encode_e1_tokens, encode_json_decode

TOKENS = st.lists(st.integers(0, 2**24 - 1), min_size=1, max_size=40)
json_values = st.recursive(st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                          max_size=3), max_leaves=8)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=5)


def test_examples() -> None:
    assert prefill_dialect(b'{"messages":[]}') is Dialect.PREFILL_JSON
    assert prefill_dialect(b"\n {}") is Dialect.PREFILL_JSON
    assert prefill_dialect(encode_e1_tokens([123])) is Dialect.PREFILL_E1  # 7B 00 00 00 starts with "{"
    assert prefill_dialect(encode_e1_tokens([0x7B20])) is Dialect.PREFILL_E1  # 20 7B 00 00: whitespace then "{"
    assert prefill_dialect(b"") is Dialect.PREFILL_JSON  # NEW rejects it; the JSON path says why
    assert prefill_dialect(b"hello") is Dialect.PREFILL_JSON
    assert decode_dialect(b'{"n_predict":4}') is Dialect.DECODE_PIN
    assert decode_dialect(b'{"n_predict":4,"stream":false}') is Dialect.DECODE_SPEC
    assert decode_dialect(b'{"n_predict":4,"stream":true}') is Dialect.DECODE_PIN
    assert decode_dialect(b'{"n_predict":4,') is Dialect.DECODE_PIN  # broken JSON: the parser says why
    assert decode_dialect(encode_e1_decode(16, [1, 2, 123, 4, 5, 6, 7, 8])) is Dialect.DECODE_E1
    assert decode_dialect(encode_e1_decode(-1, [])) is Dialect.DECODE_E1
    assert decode_dialect(encode_decode_v3({}, b"[]", b"")) is Dialect.DECODE_V3
    assert decode_dialect(b"\x00" * 5) is Dialect.DECODE_V3  # broken: NEW's validator names the rule
    assert [d.label for d in Dialect] == ["json", "e1", "v3", "pin", "json-frames", "e1"]


@given(TOKENS)
def test_any_e1_prefill(tokens: list[int]) -> None:
    assert prefill_dialect(encode_e1_tokens(tokens)) is Dialect.PREFILL_E1


@given(st.integers(-1, 2**24 - 1), st.lists(st.integers(0, 2**24 - 1), max_size=40))
def test_any_e1_decode(n_predict: int, tokens: list[int]) -> None:
    payload = encode_e1_decode(n_predict, tokens)
    assert decode_dialect(payload) is Dialect.DECODE_E1 and not looks_like_decode_v3_prefix(payload[:16])


@given(json_objects, st.sampled_from(["", " ", "\n\t"]))
def test_any_json(body: dict, ws: str) -> None:
    data = (ws + json.dumps(body)).encode()
    want = Dialect.DECODE_SPEC if body.get("stream") is False else Dialect.DECODE_PIN
    assert prefill_dialect(data) is Dialect.PREFILL_JSON and decode_dialect(data) is want
    assert not looks_like_decode_v3_prefix(data[:16])


@settings(max_examples=50)
@given(st.binary(max_size=30), st.binary(max_size=30), st.text(max_size=5))
def test_any_v3(prompt: bytes, kv: bytes, model: str) -> None:
    frame = encode_decode_v3({"model": model}, prompt, kv)
    assert decode_dialect(frame) is Dialect.DECODE_V3 and looks_like_decode_v3_prefix(frame[:16])


def test_pin_stream_follows_only_ok_0_0_to_a_pin_decode() -> None:
    assert pin_stream_follows(decode_dialect(encode_json_decode(4, None)), ResponseHeader(Status.OK, 0, 0))
    for dialect, head in [
        (Dialect.DECODE_PIN, ResponseHeader(Status.OK, 2, 0)),  # a meta: a complete response
        (Dialect.DECODE_PIN, ResponseHeader(Status.ERROR, 0, 0)),
        (Dialect.DECODE_PIN, ResponseHeader(Status.OK, 0, 9)),
        (Dialect.DECODE_SPEC, ResponseHeader(Status.OK, 0, 0)),  # spec answer with no tokens: complete
        (Dialect.DECODE_E1, ResponseHeader(Status.OK, 0, 0)),
        (None, ResponseHeader(Status.OK, 0, 0)),
    ]:
        assert not pin_stream_follows(dialect, head)
