"""KV blob formats (docs/protocol.md §7): round trips, golden bytes, limits, struct ≡ construct."""
from __future__ import annotations

import struct

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from codec.errors import CodecError, LocalProtocolError, MalformedPayload, Truncated
from codec.kvblob import (
    KvBlobHeader,
    KvCheckpoint,
    encode_kv_blob_header,
    kv_header_need,
    parse_kv_blob,
    parse_kv_blob_header,
    parse_kv_blob_header_construct,
    split_logits_tail,
)
from tests.helpers import outcome

I32 = st.integers(-(2**31), 2**31 - 1)
U32 = st.integers(0, 2**32 - 1)
checkpoints = st.builds(
    KvCheckpoint,
    pos_min=I32,
    pos_max=I32,
    n_tokens=st.integers(-(2**63), 2**63 - 1),
    tgt=st.binary(max_size=40),
    dft=st.binary(max_size=40),
)


@st.composite
def headers(draw: st.DrawFn) -> KvBlobHeader:
    version = draw(st.sampled_from([1, 2, 3]))
    n_past = draw(U32)
    if version == 1:
        assume(n_past & 0xFF not in (2, 3))  # would be misdetected as v2/v3 (inherent)
        return KvBlobHeader(1, n_past, tuple(draw(st.lists(I32, max_size=20))))
    ck = draw(st.none() | checkpoints)
    recurrent = version == 3 and ck is not None and draw(st.booleans())
    flags = (1 if ck else 0) | (2 if recurrent else 0)
    return KvBlobHeader(version, n_past, tuple(draw(st.lists(I32, max_size=20))), flags, ck)


def encode(h: KvBlobHeader) -> bytes:
    return encode_kv_blob_header(h.version, h.n_past, h.tokens, h.checkpoint, recurrent_only=h.recurrent_only)


@st.composite
def mutated_blobs(draw: st.DrawFn) -> bytes:
    """Valid blobs bent a little: truncated, a byte changed, junk appended."""
    data = bytearray(encode(draw(headers())) + draw(st.binary(max_size=16)))
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["cut", "flip", "append"]))
        if op == "cut":
            del data[draw(st.integers(0, len(data))) :]
        elif op == "flip" and data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        else:
            data += draw(st.binary(max_size=8))
    return bytes(data)


garbage = st.binary(max_size=120) | mutated_blobs()


# ---- round trips -----------------------------------------------------------------------------


@given(headers(), st.binary(max_size=64), st.integers(1, 8), st.booleans())
def test_round_trip(h: KvBlobHeader, state: bytes, n_vocab: int, with_logits: bool) -> None:
    head = encode(h)
    logits = bytes(range(4 * n_vocab)) if with_logits else b""
    blob = head + state + logits
    layout = parse_kv_blob(blob, n_vocab=n_vocab, has_logits=with_logits)
    assert layout.header == h
    assert layout.state_offset == len(head)
    assert blob[layout.state_offset : layout.state_offset + layout.state_len] == state
    assert layout.logits_offset == (len(head) + len(state) if with_logits else None)
    # The writer's view (state_size from meta, auto logits) finds the same split.
    assert parse_kv_blob(blob, n_vocab=n_vocab, state_size=len(state)) == layout
    assert parse_kv_blob_header(blob) == (h, len(head))


def test_golden_v3_header() -> None:
    got = encode_kv_blob_header(3, 7, [1, -2])
    assert got == bytes.fromhex("03" "07000000" "02000000" "01000000" "feffffff" "00")


def test_golden_v2_checkpoint() -> None:
    got = encode_kv_blob_header(2, 1, [], KvCheckpoint(-1, 5, 6, b"T", b"DD"))
    want = (
        bytes.fromhex("02" "01000000" "00000000" "01")
        + struct.pack("<iiqQ", -1, 5, 6, 1) + b"T" + struct.pack("<Q", 2) + b"DD"
    )
    assert got == want


def test_golden_v1() -> None:
    assert encode_kv_blob_header(1, 0x100, [9]) == bytes.fromhex("00010000" "01000000" "09000000")
    layout = parse_kv_blob(bytes.fromhex("00010000" "01000000" "09000000") + b"STATE")
    assert layout.header == KvBlobHeader(1, 0x100, (9,)) and layout.state_len == 5


def test_v1_with_low_byte_2_is_read_as_v2() -> None:
    legacy = encode_kv_blob_header(1, 2, [])  # n_past=2 → first byte 0x02
    with pytest.raises(Truncated):  # 8 bytes read as v2: needs tokens + flags
        parse_kv_blob(legacy)


# ---- limits: claims are checked before allocating --------------------------------------------


@pytest.mark.parametrize("first", [b"\x03", b"\x00"])
def test_huge_token_count_is_truncated_not_allocated(first: bytes) -> None:
    head = first + struct.pack("<I", 1) + struct.pack("<I", 4_000_000_000)
    if first == b"\x00":
        head = struct.pack("<II", 1, 4_000_000_000)
    with pytest.raises(Truncated) as e:
        parse_kv_blob((head + bytes(20))[:20])
    assert e.value.rule == "kv.tokens"


def test_huge_checkpoint_sizes() -> None:
    head = encode_kv_blob_header(3, 1, [1], KvCheckpoint(0, 0, 1, b"", b""))
    tgt_at = len(head) - 8 - 8  # tgt_size u64, then dft_size u64
    bad = bytearray(head + b"state")
    bad[tgt_at : tgt_at + 8] = struct.pack("<Q", 2**64 - 1)
    with pytest.raises(Truncated) as e:
        parse_kv_blob(bytes(bad))
    assert e.value.rule == "kv.checkpoint"
    bad = bytearray(head + b"state")
    bad[tgt_at + 8 : tgt_at + 16] = struct.pack("<Q", 10**12)
    with pytest.raises(Truncated, match="dft") as e:
        parse_kv_blob(bytes(bad))


@pytest.mark.parametrize(
    ("blob", "rule"),
    [
        (b"", "kv.short"),
        (b"\x00\x00\x00", "kv.short"),
        (b"\x03\x00\x00\x00\x00\x00\x00\x00", "kv.short"),
        (b"\x03" + struct.pack("<II", 0, 1) + b"\x01\x00\x00\x00", "kv.tokens"),  # no flags byte
        (b"\x02" + struct.pack("<II", 0, 0) + b"\x01" + bytes(10), "kv.checkpoint"),
    ],
)
def test_truncation_rules(blob: bytes, rule: str) -> None:
    with pytest.raises(Truncated) as e:
        parse_kv_blob(blob)
    assert e.value.rule == rule


# ---- where the state ends --------------------------------------------------------------------


def test_logits_modes() -> None:
    head = encode_kv_blob_header(3, 3, [1, 2, 3])
    blob = head + b"S" * 12 + b"L" * 8
    # auto without state_size: the whole rest is state (C++ needs the loader's count)
    assert parse_kv_blob(blob, n_vocab=2).logits_offset is None
    assert parse_kv_blob(blob, n_vocab=2, has_logits=True).state_len == 12
    assert parse_kv_blob(blob, has_logits=False).state_len == 20
    assert parse_kv_blob(blob, n_vocab=2, state_size=12).logits_offset == len(head) + 12
    assert parse_kv_blob(blob, n_vocab=5, state_size=20).logits_offset is None
    with pytest.raises(MalformedPayload) as e:
        parse_kv_blob(blob, n_vocab=3, state_size=12)
    assert e.value.rule == "kv.trailing"
    with pytest.raises(Truncated) as e:
        parse_kv_blob(blob, n_vocab=2, state_size=30)
    assert e.value.rule == "kv.state_size"
    with pytest.raises(Truncated) as e:
        parse_kv_blob(head + b"xy", n_vocab=2, has_logits=True)
    assert e.value.rule == "kv.logits"
    with pytest.raises(LocalProtocolError):
        parse_kv_blob(blob, has_logits=True)  # n_vocab required


def test_split_logits_tail_is_the_cpp_rule() -> None:
    head = encode_kv_blob_header(2, 1, [5])
    layout = parse_kv_blob(head + b"S" * 10 + b"L" * 16)
    split = split_logits_tail(layout, consumed=10, n_vocab=4)
    assert (split.state_len, split.logits_offset) == (10, len(head) + 10)
    # leftover of any other size: not logits, ignored like the C++ does
    assert split_logits_tail(layout, consumed=11, n_vocab=4) == layout
    with pytest.raises(LocalProtocolError):
        split_logits_tail(layout, consumed=99, n_vocab=4)


def test_min_state_for_streams() -> None:
    head = encode_kv_blob_header(3, 0, [])
    assert parse_kv_blob(head + bytes(8), min_state=8).state_len == 8
    with pytest.raises(Truncated) as e:
        parse_kv_blob(head + bytes(7), min_state=8)
    assert e.value.rule == "kv.stream"


# ---- streaming: kv_header_need ---------------------------------------------------------------


@given(headers(), st.binary(max_size=16))
def test_header_need_drives_a_streaming_reader(h: KvBlobHeader, state: bytes) -> None:
    blob = encode(h) + state
    have = 0
    for _ in range(10):
        need = kv_header_need(blob[:have], len(blob))
        if need <= have:
            break
        assert need <= len(blob)
        have = need
    assert need == len(encode(h))
    assert parse_kv_blob_header(blob[:need], total_len=len(blob)) == (h, need)


def test_header_from_a_short_prefix_is_incomplete() -> None:
    blob = encode_kv_blob_header(3, 0, [1, 2, 3]) + bytes(8)
    with pytest.raises(Truncated) as e:
        parse_kv_blob_header(blob[:10], total_len=len(blob))
    assert e.value.rule == "kv.incomplete"


# ---- garbage and the differential test -------------------------------------------------------


@settings(max_examples=300)
@given(garbage, st.none() | st.integers(1, 4), st.sampled_from([None, True, False]), st.none() | st.integers(0, 40))
def test_garbage_only_raises_codec_errors(blob: bytes, n_vocab, has_logits, state_size) -> None:
    if has_logits and n_vocab is None:
        n_vocab = 1
    try:
        parse_kv_blob(blob, n_vocab=n_vocab, has_logits=has_logits, state_size=state_size, min_state=2)
    except CodecError:
        pass
    for cut in (0, len(blob) // 2):
        try:
            kv_header_need(blob[:cut], len(blob))
        except CodecError:
            pass


@settings(max_examples=300)
@given(garbage)
def test_struct_path_equals_construct_path(blob: bytes) -> None:
    assert outcome(parse_kv_blob_header, blob) == outcome(parse_kv_blob_header_construct, blob)


# ---- encoder refuses what the wire cannot carry ----------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(version=4, n_past=0, tokens=[]),
        dict(version=3, n_past=-1, tokens=[]),
        dict(version=3, n_past=0, tokens=[2**31]),
        dict(version=1, n_past=0, tokens=[], checkpoint=KvCheckpoint(0, 0, 0)),
        dict(version=2, n_past=0, tokens=[], checkpoint=KvCheckpoint(0, 0, 0), recurrent_only=True),
        dict(version=3, n_past=0, tokens=[], flags=1),
        dict(version=3, n_past=0, tokens=[], checkpoint=KvCheckpoint(2**31, 0, 0)),
    ],
)
def test_encoder_rejects(kwargs: dict) -> None:
    with pytest.raises(LocalProtocolError):
        encode_kv_blob_header(**kwargs)


def test_explicit_extra_flag_bits_round_trip() -> None:
    head = encode_kv_blob_header(3, 1, [], flags=0x80)
    assert parse_kv_blob(head).header.flags == 0x80
