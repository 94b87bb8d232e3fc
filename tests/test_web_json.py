"""The HTTP side's JSON: orjson where it answers, the standard library where it refuses, and the
same values read and written as before (codec.json_text.web_json, http.errors.read_json_object)."""
from __future__ import annotations

import asyncio
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codec.json_text import web_json
from hydra_rpc.http.errors import ApiError, read_json_object

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_web_json_reads_back_as_the_value_written(value) -> None:
    out = web_json(value)
    assert json.loads(out) == value
    assert out == web_json(json.loads(out))


def test_web_json_is_compact_utf8() -> None:
    assert web_json({"a": [1, "é", None, True], "b": 0.5}) == '{"a":[1,"é",null,true],"b":0.5}'.encode()


def test_web_json_writes_a_non_finite_number_as_null_as_llama_server_does() -> None:
    assert web_json({"logprob": -math.inf, "x": math.nan, "y": [math.inf]}) == b'{"logprob":null,"x":null,"y":[null]}'


@pytest.mark.parametrize("value, expected", [
    ({"a": "\ud800", "b": "é"}, None),  # a model's text may hold a lone surrogate: written as its escape
    ({1: "a", "b": 2}, {"1": "a", "b": 2}),  # a key that is not a string, as json.dumps writes it
    ({"n": 2**70}, {"n": 2**70}),  # an integer beyond 64 bits, exactly
])
def test_web_json_hands_what_orjson_refuses_to_the_standard_encoder(value, expected) -> None:
    out = web_json(value)
    assert json.loads(out) == (value if expected is None else expected)


class _Body:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def read(self) -> bytes:
        return self.raw


def _read(raw: bytes):
    return asyncio.run(asyncio.wait_for(read_json_object(_Body(raw)), 10))  # type: ignore[arg-type]


@pytest.mark.parametrize("raw, expected", [
    (b'{"prompt": "hi", "n": [1, 2.5, null]}', {"prompt": "hi", "n": [1, 2.5, None]}),
    (b'{"a": "\\ud83d\\ude00", "b": "\\\\ud800"}', {"a": "\U0001F600", "b": "\\ud800"}),
    ('\ufeff{"a": 1}'.encode(), {"a": 1}),  # a BOM is skipped, as nlohmann skips it
    (b'{"a": 1, "a": 2}', {"a": 2}),  # the last of a repeated key, as both parsers keep it
    (b'{"seed": 18446744073709551615}', {"seed": 2**64 - 1}),
])
def test_a_body_reads_as_before(raw, expected) -> None:
    assert _read(raw) == expected


def test_a_body_with_nan_reads_as_the_standard_parser_reads_it() -> None:
    assert math.isnan(_read(b'{"t": NaN}')["t"])  # orjson refuses it; the standard parser decides, as before


def test_an_integer_beyond_64_bits_reads_as_a_float_as_nlohmann_reads_it() -> None:
    assert _read(b'{"seed": 18446744073709551616}') == {"seed": 18446744073709551616.0}


@pytest.mark.parametrize("raw, message", [
    (b'{"a": "\\ud800"}', "unpaired UTF-16 surrogate"),
    (b'{"\\udc00": 1}', "unpaired UTF-16 surrogate"),
    (b"[" * 100_000, "invalid JSON body"),
    (b'{"a": 1', "invalid JSON body"),
    (b"\xff{}", "invalid JSON body"),
    (b"[1, 2]", "must be a JSON object"),
])
def test_a_bad_body_is_a_400_that_says_why(raw, message) -> None:
    with pytest.raises(ApiError) as e:
        _read(raw)
    assert e.value.status == 400 and message in e.value.message
