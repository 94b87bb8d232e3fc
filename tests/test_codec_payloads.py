"""Engine payloads of every dialect (docs/protocol.md §6, §9, §10): round trips, rules, dialect detection."""
from __future__ import annotations

import json
import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codec.dialects import decode_dialect, prefill_dialect
from codec.errors import CodecError, FrameTooLarge, LocalProtocolError, MalformedPayload, Truncated
from codec.payloads import (
    ExpertModeRequest,
    PieceStreamDecoder,
    SwapQuantRequest,
    TokenFrame,
    decode_e1_decode,
    decode_e1_decode_construct,
    decode_e1_tokens,
    decode_e1_tokens_construct,
    decode_meta,
    decode_token_frames,
    decode_token_frames_construct,
    dumps_compact,
    encode_e1_decode,
    encode_e1_tokens,
    encode_expert_mode,
    encode_json_decode,
    encode_meta,
    encode_piece,
    encode_pipeline_attach,
    encode_swap_quant,
    encode_token_frame,
    loads_json,
    parse_configure,
    parse_expert_mode,
    parse_json_decode,
    parse_json_object,
    parse_pipeline_attach,
    parse_prefill_json,
    parse_swap_quant,
    parse_swap_quant_construct,
)
from tests.helpers import outcome

I32 = st.integers(-(2**31), 2**31 - 1)
TOKENS = st.lists(st.integers(0, 2**24 - 1), min_size=1, max_size=40)
json_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=10) | st.floats(allow_nan=False, allow_infinity=False)
json_values = st.recursive(json_scalars, lambda x: st.lists(x, max_size=3) | st.dictionaries(st.text(max_size=6), x, max_size=3), max_leaves=10)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=5)


# ---- JSON helpers and meta -------------------------------------------------------------------


@given(json_objects)
def test_meta_round_trip_is_compact(meta: dict) -> None:
    data = encode_meta(meta)
    assert decode_meta(data) == meta
    assert data == json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode()


def test_meta_like_nlohmann_dump() -> None:
    assert encode_meta({"n_past": 3, "model_alias": "é", "x": [1, True, None]}) == '{"n_past":3,"model_alias":"é","x":[1,true,null]}'.encode()
    assert encode_meta(None) == b"" and decode_meta(b"") is None
    for bad in ({"x": math.nan}, {"x": object()}, {"x": "a" * 0x1000000}, [1]):
        with pytest.raises(LocalProtocolError):
            encode_meta(bad)  # type: ignore[arg-type]
    with pytest.raises(MalformedPayload) as e:
        decode_meta(b"[1]")
    assert e.value.rule == "meta.not_object"


@pytest.mark.parametrize(
    "bad",
    [b"NaN", b'{"a":Infinity}', '{"a":1}'.encode("utf-16"), b"\xff", b"[" * 100_000, b"1" * 5000, b"{} x", b""],
)
def test_loads_json_is_strict(bad: bytes) -> None:
    with pytest.raises(MalformedPayload) as e:
        loads_json(bad, "some.rule")
    assert e.value.rule == "some.rule"


@pytest.mark.parametrize("text", [r'{"a":"\ud800"}', r'{"\udc00":1}', r'["x",{"b":["\uDBFF tail"]}]',
                                  r'{"a":"\ude00\ud83d"}'])
def test_loads_json_refuses_an_unpaired_surrogate_escape(text: str) -> None:
    """nlohmann refuses it; json.loads keeps a code point no UTF-8 can hold, which failed
    later, in the tokenizer, as an internal error."""
    with pytest.raises(MalformedPayload, match="unpaired UTF-16 surrogate") as e:
        loads_json(text.encode(), "some.rule")
    assert e.value.rule == "some.rule"


def test_loads_json_keeps_surrogate_pairs_and_escaped_backslashes() -> None:
    assert loads_json(rb'{"a":"\ud83d\ude00"}', "r") == {"a": "\U0001F600"}
    assert loads_json(rb'{"a":"\\ud800"}', "r") == {"a": "\\ud800"}


def test_dumps_compact_writes_a_lone_surrogate_as_its_escape() -> None:
    """A model's JSON text may hold one (a tool call's arguments): the reply stays valid JSON."""
    out = dumps_compact({"a": "\ud800", "b": "é"})
    assert json.loads(out) == {"a": "\ud800", "b": "é"} and out.isascii()


def test_parse_json_object() -> None:
    assert parse_json_object(b' {"a":1} ', "r") == {"a": 1}
    assert parse_json_object(b"", "r", allow_empty=True) == {}
    for bad in (b"", b"[]", b"null", b"3"):
        with pytest.raises(MalformedPayload):
            parse_json_object(bad, "r")


# ---- E1 raw tokens ---------------------------------------------------------------------------


def test_e1_golden() -> None:
    # tests/e1_rpc_test.py sends struct.pack("<5I", 1, 2, 3, 4, 5)
    assert encode_e1_tokens([1, 2, 3, 4, 5]) == struct.pack("<5I", 1, 2, 3, 4, 5)
    assert encode_e1_decode(16, [7]) == struct.pack("<ii", 16, 7)


@given(st.lists(I32, max_size=50))
def test_e1_tokens_round_trip(tokens: list[int]) -> None:
    assert decode_e1_tokens(encode_e1_tokens(tokens)) == tokens


@given(I32, st.lists(I32, max_size=50))
def test_e1_decode_round_trip(n_predict: int, tokens: list[int]) -> None:
    assert decode_e1_decode(encode_e1_decode(n_predict, tokens)) == (n_predict, tokens)


def test_e1_rules() -> None:
    with pytest.raises(MalformedPayload) as e:
        decode_e1_tokens(b"\x01\x00\x00")
    assert e.value.rule == "e1.tokens_len"
    with pytest.raises(Truncated) as e:
        decode_e1_decode(b"\x01")
    assert e.value.rule == "e1.decode_short"
    with pytest.raises(MalformedPayload) as e:
        decode_e1_decode(b"\x01\x00\x00\x00\x05")
    assert e.value.rule == "e1.tokens_len"
    with pytest.raises(LocalProtocolError):
        encode_e1_tokens([2**31])


@given(st.binary(max_size=64))
def test_e1_struct_equals_construct(data: bytes) -> None:
    assert outcome(decode_e1_tokens, data) == outcome(decode_e1_tokens_construct, data)
    assert outcome(decode_e1_decode, data) == outcome(decode_e1_decode_construct, data)


# ---- J17 / PIN JSON DECODE -------------------------------------------------------------------


def test_json_decode() -> None:
    req = parse_json_decode(encode_json_decode(8, [{"role": "user", "content": "x"}], stream=True, temperature=0))
    assert (req.n_predict, req.messages, req.stream, req.body["temperature"]) == (8, [{"role": "user", "content": "x"}], True, 0)
    assert parse_json_decode(b'{"n_predict":0,"messages":null}').messages is None
    assert parse_json_decode(b'{"n_predict":0}').stream is None


@pytest.mark.parametrize(
    ("body", "rule"),
    [
        (b'{"messages":[]}', "decode.n_predict"),
        (b'{"n_predict":-1}', "decode.n_predict"),
        (b'{"n_predict":1.5}', "decode.n_predict"),
        (b'{"n_predict":true}', "decode.n_predict"),
        (b'{"n_predict":"4"}', "decode.n_predict"),
        (b'{"n_predict":2147483648}', "decode.n_predict"),
        (b'{"n_predict":1,"messages":{}}', "decode.messages"),
        (b'{"n_predict":1,"stream":1}', "decode.stream"),
        (b"[1]", "decode.json"),
        (b"", "decode.json"),
    ],
)
def test_json_decode_rules(body: bytes, rule: str) -> None:
    with pytest.raises(MalformedPayload) as e:
        parse_json_decode(body)
    assert e.value.rule == rule


# ---- PIN pieces ------------------------------------------------------------------------------


def test_piece_golden() -> None:
    assert encode_piece("hé") == b"\x03\x00\x00\x00h\xc3\xa9"
    assert encode_piece(b"") == b"\x00\x00\x00\x00"


@given(st.lists(st.binary(max_size=20), max_size=10), st.lists(st.integers(1, 9), min_size=1, max_size=20))
def test_piece_stream_any_split(pieces: list[bytes], sizes: list[int]) -> None:
    wire = b"".join(map(encode_piece, pieces))
    dec, got, pos, i = PieceStreamDecoder(), [], 0, 0
    while pos < len(wire):
        step = sizes[i % len(sizes)]
        got += dec.feed(wire[pos : pos + step])
        pos, i = pos + step, i + 1
    dec.eof()
    assert got == pieces


def test_piece_stream_limits() -> None:
    dec = PieceStreamDecoder(max_piece=4)
    assert dec.feed(encode_piece(b"abcd")) == [b"abcd"]
    with pytest.raises(FrameTooLarge) as e:
        dec.feed(b"\x05\x00\x00\x00")
    assert e.value.rule == "pin.piece_len" and e.value.recoverable is False
    with pytest.raises(FrameTooLarge):
        dec.feed(b"")  # poisoned: the stream is lost
    dec = PieceStreamDecoder()
    dec.feed(b"\x05\x00\x00\x00ab")
    assert dec.buffered == 6
    with pytest.raises(Truncated) as e:
        dec.eof()
    assert e.value.rule == "pin.piece_truncated"


# ---- spec 9-byte token frames ----------------------------------------------------------------


def test_token_frame_golden() -> None:
    assert encode_token_frame(0x0102, -0.5, final=True) == b"\x02\x01\x00\x00" + struct.pack("<f", -0.5) + b"\x01"


@given(st.lists(st.tuples(st.integers(0, 2**32 - 1), st.floats(width=32, allow_nan=False), st.integers(0, 255)), max_size=10))
def test_token_frames_round_trip(frames: list) -> None:
    wire = b"".join(encode_token_frame(t, lp, flags=f) for t, lp, f in frames)
    got = decode_token_frames(wire)
    assert got == [TokenFrame(t, lp, f) for t, lp, f in frames]
    assert [g.final for g in got] == [bool(f & 1) for _, _, f in frames]


@given(st.binary(max_size=40))
def test_token_frames_struct_equals_construct(data: bytes) -> None:
    a, b = outcome(decode_token_frames, data), outcome(decode_token_frames_construct, data)
    # compare bytes, not floats: NaN != NaN
    enc = lambda o: (o[0], None if o[1] is None else b"".join(encode_token_frame(f.token_id, f.logprob, flags=f.flags) for f in o[1]))
    assert enc(a) == enc(b)
    if a[0] == "ok" and not any(f.logprob != f.logprob for f in a[1]):
        # (a signalling NaN comes back quieted through a Python float: not a byte round trip)
        assert enc(a)[1] == data


def test_token_frames_len_rule() -> None:
    with pytest.raises(MalformedPayload) as e:
        decode_token_frames(bytes(10))
    assert e.value.rule == "spec.frames_len"


# ---- SET_EXPERT_MODE -------------------------------------------------------------------------


def test_expert_mode() -> None:
    assert parse_expert_mode(b"solo") == ExpertModeRequest("solo")
    assert parse_expert_mode(b"combined") == ExpertModeRequest("combined")
    assert parse_expert_mode(b' {"mode":"combined","peer":"h:1"}') == ExpertModeRequest("combined", "h:1", True)
    for mode, peer, as_json in (("solo", None, False), ("combined", "p:2", False), ("solo", None, True)):
        assert parse_expert_mode(encode_expert_mode(mode, peer, json_form=as_json)) == ExpertModeRequest(mode, peer, as_json or peer is not None)
    for bad, rule in ((b"Solo", "expert_mode.mode"), (b"solo\n", "expert_mode.mode"), (b"", "expert_mode.mode"),
                      (b"\xff", "expert_mode.mode"), (b'{"mode":"x"}', "expert_mode.mode"),
                      (b'{"mode":"solo","peer":3}', "expert_mode.peer"), (b"{", "expert_mode.json")):
        with pytest.raises(MalformedPayload) as e:
            parse_expert_mode(bad)
        assert e.value.rule == rule


# ---- SWAP_QUANT ------------------------------------------------------------------------------


@given(st.text(max_size=20), st.text(max_size=20))
def test_swap_quant_round_trip(qk: str, pattern: str) -> None:
    assert parse_swap_quant(encode_swap_quant(qk, pattern)) == SwapQuantRequest(qk, pattern)


def test_swap_quant_golden_and_rules() -> None:
    assert encode_swap_quant("Q4_K", "ffn_.*") == b"\x04\x00Q4_Kffn_.*"
    with pytest.raises(MalformedPayload) as e:
        parse_swap_quant(b"\xff\xffabc")  # qk_len 65535 > 3: refused, nothing allocated
    assert e.value.rule == "swap_quant.qk_len"
    with pytest.raises(Truncated) as e:
        parse_swap_quant(b"\x01")
    assert e.value.rule == "swap_quant.short"
    with pytest.raises(MalformedPayload) as e:
        parse_swap_quant(b"\x01\x00\xff")
    assert e.value.rule == "swap_quant.utf8"


@given(st.binary(max_size=30))
def test_swap_quant_struct_equals_construct(data: bytes) -> None:
    assert outcome(parse_swap_quant, data) == outcome(parse_swap_quant_construct, data)


# ---- JSON bodies -----------------------------------------------------------------------------


def test_json_bodies() -> None:
    assert parse_configure(b"") == {} and parse_configure(b'{"n_ctx":4096}') == {"n_ctx": 4096}
    assert parse_prefill_json(b'{"messages":[],"model":"a","hydra_config":{}}')["model"] == "a"
    assert parse_pipeline_attach(encode_pipeline_attach("h:1", "x")) == {"peer": "h:1", "ot_split": "x"}
    for fn, bad, rule in (
        (parse_configure, b"[]", "configure.json"),
        (parse_prefill_json, b"", "prefill.json"),
        (parse_prefill_json, b'{"model":1}', "prefill.model"),
        (parse_prefill_json, b'{"hydra_config":[]}', "prefill.hydra_config"),
        (parse_pipeline_attach, b'{"peer":1}', "pipeline_attach.fields"),
    ):
        with pytest.raises(MalformedPayload) as e:
            fn(bad)
        assert e.value.rule == rule


# ---- garbage ---------------------------------------------------------------------------------

DECODERS = [
    decode_e1_tokens, decode_e1_decode, parse_json_decode, decode_token_frames, parse_expert_mode,
    parse_swap_quant, parse_configure, parse_prefill_json, parse_pipeline_attach, decode_meta,
    prefill_dialect, decode_dialect, lambda b: PieceStreamDecoder(max_piece=64).feed(b),
]


@settings(max_examples=300)
@given(st.binary(max_size=64) | st.builds(lambda o: json.dumps(o).encode(), json_values))
def test_garbage_only_raises_codec_errors(data: bytes) -> None:
    for decode in DECODERS:
        try:
            decode(data)
        except CodecError:
            pass
