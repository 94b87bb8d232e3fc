"""DECODE v3 frames (docs/protocol.md §8) and the xxh3 helpers: every rule by id, order, round trips."""
from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codec.decode_v3 import (
    HYDRA_MAX_JSON_HEADER,
    HYDRA_MAX_PROMPT_BYTES,
    HYDRA_MAX_STATE_BYTES,
    build_control_header,
    encode_decode_v3,
    encode_decode_v3_frame,
    kv_segment_need,
    parse_decode_v3,
    parse_decode_v3_prefix,
    parse_decode_v3_prefix_construct,
    parse_prompt_segment,
    validate_decode_v3,
    validate_kv_segment,
    verify_segment_hash,
)
from codec.errors import CodecError, MalformedPayload, Truncated
from codec.hashing import Xxh3Stream, kv_hash_str, parse_hash_str, xxh3_64
from codec.kvblob import KvCheckpoint, encode_kv_blob_header
from tests.helpers import outcome

MESSAGES = b'[{"role":"user","content":"hi"}]'
KV = encode_kv_blob_header(3, 2, [1, 2]) + b"MAGISEQ0" + b"state"


# ---- hashing ---------------------------------------------------------------------------------


def test_xxh3_vectors() -> None:
    assert xxh3_64(b"") == 0x2D06800538D394C2
    assert kv_hash_str(b"") == "xxh3:2d06800538d394c2"
    assert kv_hash_str(0xAB) == "xxh3:00000000000000ab"


@pytest.mark.parametrize("good", ["xxh3:2d06800538d394c2", "xxh3:2D06800538D394C2", "xxh3:0", "xxh3:ffffffffffffffff"])
def test_parse_hash_str_accepts(good: str) -> None:
    assert parse_hash_str(good) == int(good[5:], 16)


@pytest.mark.parametrize(
    "bad", ["", "2d06800538d394c2", "XXH3:00", "xxh3:", "xxh3:0x12", "xxh3: 12", "xxh3:1_2", "xxh3:-1",
            "xxh3:g", "xxh3:" + "1" * 17, 5, None, b"\xff"],
)
def test_parse_hash_str_rejects(bad: object) -> None:
    with pytest.raises(MalformedPayload) as e:
        parse_hash_str(bad)
    assert e.value.rule == "hash.format"


@given(st.binary(max_size=200), st.lists(st.integers(0, 200), max_size=4))
def test_stream_hash_equals_one_shot(data: bytes, cuts: list[int]) -> None:
    h = Xxh3Stream()
    last = 0
    for c in sorted(cuts) + [len(data)]:
        h.update(memoryview(data)[last : max(last, c)])
        last = max(last, c)
    assert h.intdigest() == xxh3_64(data) and h.length == len(data)
    assert h.kv_hash_str() == kv_hash_str(data) == "xxh3:" + h.hexdigest()


# ---- encoder shape and round trip ------------------------------------------------------------


def test_control_header_has_the_csharp_shape() -> None:
    hdr = build_control_header(MESSAGES, KV, model="gemma")
    assert list(hdr) == ["v", "model", "kv_metadata", "model_metadata", "generation", "segments"]
    assert hdr["v"] == 3 and hdr["model"] == "gemma"
    assert set(hdr["kv_metadata"]) == {"n_past", "tokenizer", "model_name", "model_quant", "model_capabilities"}
    assert hdr["segments"] == [
        {"id": "prompt", "offset": 0, "len": len(MESSAGES), "hash": kv_hash_str(MESSAGES)},
        {"id": "kv", "offset": len(MESSAGES), "len": len(KV), "hash": kv_hash_str(KV)},
    ]
    assert build_control_header(MESSAGES)["segments"][1] == {"id": "kv", "offset": len(MESSAGES), "len": 0, "hash": ""}


def test_frame_bytes() -> None:
    hdr = {"v": 3, "kv_metadata": {}, "segments": []}
    payload = encode_decode_v3(hdr, b"", b"")
    body = b'{"v":3,"kv_metadata":{},"segments":[]}'
    assert payload == struct.pack("<IQ", len(body), xxh3_64(body)) + body
    h, prompt, kv = parse_decode_v3(payload)
    assert (h.prompt_len, h.kv_len, bytes(prompt), bytes(kv)) == (0, 0, b"", b"")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=100)
@given(
    st.lists(st.dictionaries(st.sampled_from(["role", "content"]), st.text(max_size=10)), max_size=3),
    st.binary(max_size=40),
    st.text(max_size=10),
    st.dictionaries(st.text(max_size=6), json_values, max_size=3),
    st.sampled_from(["none", "legacy", "v3"]),
)
def test_round_trip(messages: list, state: bytes, model: str, generation: dict, kv_kind: str) -> None:
    prompt = json.dumps(messages).encode()
    kv = {
        "none": b"",
        "legacy": encode_kv_blob_header(1, 0x100, [7]) + state,  # not header-checked by NEW
        "v3": encode_kv_blob_header(3, 1, [7]) + bytes(8) + state,
    }[kv_kind]
    payload = encode_decode_v3({"model": model, "generation": generation}, prompt, kv)
    h, p, k = parse_decode_v3(payload)
    assert (bytes(p), bytes(k)) == (prompt, kv)
    assert h.model == model and h.version == 3 and h.generation == generation
    assert h.payload_len == len(payload) and h.kv_offset == len(payload) - len(kv)
    req = parse_prompt_segment(p, h.generation)
    assert req["messages"] == messages
    for key, value in generation.items():
        assert req[key] == value or key == "messages"


def test_streaming_server_flow() -> None:
    """What a server does: 12 bytes, header, prompt, kv header, then the state through a hash."""
    payload = encode_decode_v3({"model": "m"}, MESSAGES, KV)
    hdr_len, hdr_hash = parse_decode_v3_prefix(payload[:12], len(payload))
    h = validate_decode_v3(hdr_len, hdr_hash, payload[12 : 12 + hdr_len], len(payload))
    assert payload[h.prompt_offset : h.prompt_offset + h.prompt_len] == MESSAGES
    kv_stream = payload[h.kv_offset :]
    have = 0
    while (need := kv_segment_need(kv_stream[:have], h.kv_len)) > have:
        have = need
    header, header_len = validate_kv_segment(kv_stream[:have], h.kv_len)
    assert header.tokens == (1, 2) and header_len == have
    hasher = Xxh3Stream(kv_stream[:have])
    for i in range(have, h.kv_len, 3):
        hasher.update(kv_stream[i : i + 3])
    assert verify_segment_hash(h.kv_hash, hasher) is True


# ---- every rule, by id -----------------------------------------------------------------------


def frame(hdr: dict | bytes, prompt: bytes = b"", kv: bytes = b"", *, hdr_hash: int | None = None) -> bytes:
    body = hdr if isinstance(hdr, bytes) else json.dumps(hdr).encode()
    return encode_decode_v3_frame(body, prompt, kv, hdr_hash=hdr_hash)


def good_hdr(prompt: bytes = MESSAGES, kv: bytes = KV, **changes) -> dict:
    hdr = build_control_header(prompt, kv)
    hdr.update(changes)
    return hdr


def seg(id: str, offset: int, ln: int, h: str = "") -> dict:
    return {"id": id, "offset": offset, "len": ln, "hash": h}


P, K = len(MESSAGES), len(KV)
CASES = {
    "v3.short_payload": b"\x00" * 11,
    "v3.hdr_len": struct.pack("<IQ", HYDRA_MAX_JSON_HEADER + 1, 0) + b"{}",
    "v3.hdr_overrun": struct.pack("<IQ", 100, 0) + b"{" * 50,
    "v3.hdr_hash": frame(good_hdr(), MESSAGES, KV, hdr_hash=1),
    "v3.hdr_json": frame(b'{"v":3,', MESSAGES),
    "v3.version": frame(good_hdr(v=2), MESSAGES, KV),
    "v3.kv_metadata": frame({k: v for k, v in good_hdr().items() if k != "kv_metadata"}, MESSAGES, KV),
    "v3.segments_type": frame(good_hdr(segments={"id": "prompt"}), MESSAGES, KV),
    "v3.segments_count": frame(good_hdr(segments=[seg("prompt", 0, 0)] * 4)),
    "v3.segment_fields": frame(good_hdr(segments=[{"id": "prompt", "offset": 0, "len": P}]), MESSAGES),
    "v3.segment_offset": frame(good_hdr(segments=[seg("prompt", 1, P)]), MESSAGES),
    "v3.segment_id": frame(good_hdr(segments=[seg("prompt", 0, P), seg("state", P, K)]), MESSAGES, KV),
    "v3.segment_sum": frame(good_hdr(segments=[seg("prompt", 0, P)]), MESSAGES, KV),
    "v3.kv_hash_format": frame(good_hdr(segments=[seg("prompt", 0, P), seg("kv", P, K, "sha256:00")]), MESSAGES, KV),
    "v3.kv_short": frame(good_hdr(kv=b"\x03\x00"), MESSAGES, b"\x03\x00"),
    "v3.kv_tokens": frame(good_hdr(kv=b"\x03" + struct.pack("<II", 0, 1000) + bytes(20)), MESSAGES,
                          b"\x03" + struct.pack("<II", 0, 1000) + bytes(20)),
    "v3.kv_checkpoint": frame(good_hdr(kv=encode_kv_blob_header(2, 0, []) [:-1] + b"\x01" + bytes(10)), MESSAGES,
                              encode_kv_blob_header(2, 0, [])[:-1] + b"\x01" + bytes(10)),
    "v3.kv_stream": frame(good_hdr(kv=encode_kv_blob_header(3, 0, []) + bytes(7)), MESSAGES,
                          encode_kv_blob_header(3, 0, []) + bytes(7)),
    "v3.kv_hash": frame(good_hdr(segments=[seg("prompt", 0, P), seg("kv", P, K, kv_hash_str(b"other"))]),
                        MESSAGES, KV),
}


@pytest.mark.parametrize("rule", list(CASES))
def test_each_rule_has_its_own_id(rule: str) -> None:
    with pytest.raises(MalformedPayload) as e:
        parse_decode_v3(CASES[rule])
    assert e.value.rule == rule


def test_more_forms_of_the_same_rules() -> None:
    def rule_of(payload: bytes) -> str:
        with pytest.raises(MalformedPayload) as e:
            parse_decode_v3(payload)
        return e.value.rule

    assert rule_of(frame(b"[1]")) == "v3.hdr_json"
    assert rule_of(frame(b'{"v":NaN}')) == "v3.hdr_json"
    assert rule_of(frame(b"\xff")) == "v3.hdr_json"
    assert rule_of(frame({"kv_metadata": {}, "segments": []})) == "v3.version"  # missing v = 0
    assert rule_of(frame({"v": "3", "kv_metadata": {}, "segments": []})) == "v3.version"
    assert rule_of(frame({"v": 3, "kv_metadata": [], "segments": []})) == "v3.kv_metadata"
    assert rule_of(frame({"v": 3, "kv_metadata": {}})) == "v3.segments_type"
    assert rule_of(frame({"v": 3, "kv_metadata": {}, "segments": [seg("kv", 0, -1)]})) == "v3.segment_fields"
    assert rule_of(frame({"v": 3, "kv_metadata": {}, "segments": ["x"]})) == "v3.segment_fields"
    dup = frame({"v": 3, "kv_metadata": {}, "segments": [seg("kv", 0, 1), seg("kv", 1, 1)]}, b"ab")
    assert rule_of(dup) == "v3.segment_id"


def test_limits_are_checked_from_the_header_alone() -> None:
    """Prompt and kv caps fail before a single segment byte exists (payload_len is declared)."""
    for rule, prompt_len, kv_len in (
        ("v3.prompt_len", HYDRA_MAX_PROMPT_BYTES + 1, 0),
        ("v3.kv_len", 10, HYDRA_MAX_STATE_BYTES + 1),
    ):
        hdr = json.dumps({"v": 3, "kv_metadata": {}, "segments": [seg("prompt", 0, prompt_len),
                                                                    seg("kv", prompt_len, kv_len)]}).encode()
        payload_len = 12 + len(hdr) + prompt_len + kv_len
        with pytest.raises(MalformedPayload) as e:
            validate_decode_v3(len(hdr), xxh3_64(hdr), hdr, payload_len)
        assert e.value.rule == rule
    hdr = json.dumps({"v": 3, "kv_metadata": {}, "segments": [seg("prompt", 0, HYDRA_MAX_PROMPT_BYTES),
                                                                seg("kv", HYDRA_MAX_PROMPT_BYTES, HYDRA_MAX_STATE_BYTES)]})
    h = validate_decode_v3(len(hdr), xxh3_64(hdr.encode()), hdr.encode(),
                           12 + len(hdr) + HYDRA_MAX_PROMPT_BYTES + HYDRA_MAX_STATE_BYTES)
    assert (h.prompt_len, h.kv_len) == (HYDRA_MAX_PROMPT_BYTES, HYDRA_MAX_STATE_BYTES)  # caps are inclusive


def test_rule_order_follows_the_reference() -> None:
    # bad hash AND bad JSON → the hash is checked first
    with pytest.raises(MalformedPayload, match="hash") as e:
        parse_decode_v3(frame(b"not json", hdr_hash=0))
    assert e.value.rule == "v3.hdr_hash"
    # v < 3 AND no kv_metadata AND no segments → version first
    with pytest.raises(MalformedPayload) as e:
        parse_decode_v3(frame({"v": 1}))
    assert e.value.rule == "v3.version"
    # bad offset in segment 0 AND unknown id in segment 0 → offset first
    with pytest.raises(MalformedPayload) as e:
        parse_decode_v3(frame({"v": 3, "kv_metadata": {}, "segments": [seg("zzz", 5, 0)]}))
    assert e.value.rule == "v3.segment_offset"
    # segment sum wrong AND kv hash malformed → sum first
    with pytest.raises(MalformedPayload) as e:
        parse_decode_v3(frame({"v": 3, "kv_metadata": {}, "segments": [seg("kv", 0, 5, "nope")]}))
    assert e.value.rule == "v3.segment_sum"


def test_prefix_needs_payload_len_and_bytes() -> None:
    with pytest.raises(Truncated) as e:
        parse_decode_v3_prefix(b"\x00" * 5, payload_len=100)
    assert e.value.rule == "v3.prefix_short"
    with pytest.raises(Truncated) as e:
        validate_decode_v3(10, 0, b"{}", 100)
    assert e.value.rule == "v3.hdr_short"


def test_legacy_and_empty_kv_are_not_header_checked() -> None:
    assert validate_kv_segment(b"", 0) is None
    assert validate_kv_segment(b"\x00\x01", 2) is None  # legacy v1: checked by the loader, not here
    assert kv_segment_need(b"", 50) == 1
    kv = encode_kv_blob_header(3, 0, [], KvCheckpoint(0, 1, 2, b"t")) + bytes(8)
    header, header_len = validate_kv_segment(kv, len(kv))
    assert header.checkpoint == KvCheckpoint(0, 1, 2, b"t") and header_len == len(kv) - 8


# ---- prompt segment --------------------------------------------------------------------------


def test_prompt_segment() -> None:
    assert parse_prompt_segment(b"[]", None) == {"messages": []}
    got = parse_prompt_segment(b'{"messages":[],"n_predict":5}', {"n_predict": 9, "stream": False})
    assert got == {"messages": [], "n_predict": 5, "stream": False}  # only absent keys merged
    for bad, rule in ((b"", "v3.prompt_json"), (b"[", "v3.prompt_json"), (b'"x"', "v3.prompt_build"),
                      (b"5", "v3.prompt_build")):
        with pytest.raises(MalformedPayload) as e:
            parse_prompt_segment(bad, None)
        assert e.value.rule == rule
    with pytest.raises(MalformedPayload) as e:
        parse_prompt_segment(b"[]", ["not", "an", "object"])
    assert e.value.rule == "v3.prompt_build"


def test_verify_segment_hash() -> None:
    assert verify_segment_hash("", b"anything") is False
    assert verify_segment_hash(kv_hash_str(b"abc"), b"abc") is True
    assert verify_segment_hash(kv_hash_str(b"abc"), xxh3_64(b"abc")) is True
    with pytest.raises(MalformedPayload) as e:
        verify_segment_hash(kv_hash_str(b"abc"), b"abd", rule="v3.prompt_hash")
    assert e.value.rule == "v3.prompt_hash"


# ---- garbage, structured garbage, differential -----------------------------------------------


@st.composite
def headers_of_any_shape(draw: st.DrawFn) -> bytes:
    """Frames with a correct hash around arbitrary JSON, so the later rules get exercised."""
    segs = st.lists(
        st.fixed_dictionaries(
            {"id": st.sampled_from(["prompt", "kv", "x"]) | json_values, "offset": st.integers(-2, 12),
             "len": st.integers(-1, 12), "hash": st.sampled_from(["", "xxh3:1", "xxh3:z"]) | json_values}
        ) | json_values,
        max_size=4,
    )
    hdr = draw(st.fixed_dictionaries({}, optional={"v": st.integers(0, 4) | json_values,
                                                    "kv_metadata": st.just({}) | json_values,
                                                    "segments": segs | json_values}))
    return frame(json.dumps(hdr).encode(), draw(st.binary(max_size=12)), draw(st.binary(max_size=30)))


@settings(max_examples=300)
@given(st.binary(max_size=80) | headers_of_any_shape())
def test_garbage_only_raises_codec_errors(payload: bytes) -> None:
    try:
        parse_decode_v3(payload)
    except CodecError:
        pass
    try:
        parse_prompt_segment(payload, None)
    except CodecError:
        pass


@given(st.binary(max_size=20), st.integers(0, 2**40))
def test_prefix_struct_equals_construct(data: bytes, payload_len: int) -> None:
    for pl in (payload_len, None):
        assert outcome(parse_decode_v3_prefix, data, pl) == outcome(parse_decode_v3_prefix_construct, data, pl)
