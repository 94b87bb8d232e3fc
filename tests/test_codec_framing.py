"""Hydra headers and the incremental decoders."""
from __future__ import annotations

import pytest
from construct import ConstructError
from hypothesis import given, settings
from hypothesis import strategies as st

from codec.decoder import (
    NEED_DATA, PayloadChunk, RequestDecoder, RequestEnd, RequestStart, ResponseDecoder, ResponseEnd,
    ResponseStart,
)
from codec.enums import Op, Status
from codec.errors import BadMagic, CodecError, FrameTooLarge, LocalProtocolError
from codec.framing import (
    REQUEST_HEADER, RESPONSE_HEADER, decode_request_header, decode_response_header, encode_request,
    encode_request_header, encode_response, encode_response_header, pack_request_header_unchecked,
)
from codec.limits import NO_PAYLOAD_OPS, Limits


def test_magic_is_59_48_on_the_wire():
    assert encode_request(Op.INFO)[:2] == b"\x59\x48"


def test_meta_len_u24_little_endian_golden():
    # ProtocolTests.cs: 0xABCDEF is written as EF CD AB.
    assert encode_response_header(0, 0xABCDEF, 0) == b"\x00\xEF\xCD\xAB" + bytes(8)


def test_request_header_golden():
    raw = encode_request_header(Op.PREFILL, key_len=1, payload_len=0x0102030405060708, trace_len=4)
    assert raw == bytes.fromhex("5948 42 00 0100 0807060504030201 0400")


def test_oversized_fields_refused_locally():
    with pytest.raises(LocalProtocolError):
        encode_response_header(0, 1 << 24, 0)
    with pytest.raises(LocalProtocolError):
        encode_request_header(0x41, 70000, 0, 0)


@given(st.binary(min_size=14, max_size=14))
def test_request_header_struct_equals_construct(rest):
    # Every header carries the valid magic, so each case reaches the field decoding: a random
    # 16-byte header would reach it once in 65,536 cases (the bad-magic case is tested below).
    raw = b"\x59\x48" + rest
    c = REQUEST_HEADER.parse(raw)
    assert c.magic == 0x4859
    h = decode_request_header(raw)
    assert h.magic == c.magic
    assert h.op == c.op
    assert h.flags == c.flags
    assert h.key_len == c.key_len
    assert h.payload_len == c.payload_len
    assert h.trace_len == c.trace_len
    assert REQUEST_HEADER.build(dict(c)) == raw == encode_request_header(
        h.op, h.key_len, h.payload_len, h.trace_len, h.flags)


@given(st.binary(min_size=16, max_size=16).filter(lambda raw: raw[:2] != b"\x59\x48"))
def test_request_header_with_bad_magic_is_refused_by_the_struct_path(raw):
    assert REQUEST_HEADER.parse(raw).magic != 0x4859
    with pytest.raises(BadMagic):
        decode_request_header(raw)


@given(st.binary(min_size=12, max_size=12))
def test_response_header_struct_equals_construct(raw):
    c = RESPONSE_HEADER.parse(raw)
    h = decode_response_header(raw)
    assert tuple(h) == (c.status, c.meta_len, c.payload_len)
    assert RESPONSE_HEADER.build(dict(c)) == raw == encode_response_header(*h)


@given(st.binary(max_size=15))
def test_short_headers_raise_codec_errors(raw):
    with pytest.raises(CodecError):
        decode_request_header(raw)
    with pytest.raises((CodecError, ConstructError)):
        REQUEST_HEADER.parse(raw)


def _drain(dec, chunks):
    out = []
    for c in chunks:
        dec.feed(c)
        for ev in dec.events():
            out.append(ev)
    return out


def _coalesce(events):
    """Merge consecutive payload chunks so differently split streams compare equal."""
    out = []
    for ev in events:
        if isinstance(ev, PayloadChunk) and out and isinstance(out[-1], PayloadChunk):
            out[-1] = PayloadChunk(out[-1].data + ev.data)
        else:
            out.append(ev)
    return out


requests = st.lists(
    st.tuples(st.sampled_from(list(Op)), st.binary(max_size=20), st.binary(max_size=20),
              st.binary(max_size=3000)),
    min_size=1, max_size=5,
)


@settings(max_examples=60)
@given(requests, st.data())
def test_request_decoder_split_invariance(reqs, data):
    lim = Limits(default_max_payload=1 << 20, buffer_threshold=1000,
                 max_payload={})
    stream = b"".join(encode_request(op, k, p, t) for op, k, t, p in reqs)
    whole = _coalesce(_drain(RequestDecoder(lim), [stream]))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    pieces = [stream[a:b] for a, b in zip([0] + cuts, cuts + [len(stream)])]
    split = _coalesce(_drain(RequestDecoder(lim), pieces))
    bytewise = _coalesce(_drain(RequestDecoder(lim), [stream[i:i + 1] for i in range(len(stream))]))
    assert whole == split == bytewise
    starts = [e for e in whole if isinstance(e, RequestStart)]
    assert [(s.header.op, s.key, s.trace) for s in starts] == [(op, k, t) for op, k, t, _ in reqs]
    bodies, cur = [], None
    for e in whole:
        if isinstance(e, RequestStart):
            cur = b""
        elif isinstance(e, PayloadChunk):
            cur += e.data
        elif isinstance(e, RequestEnd):
            bodies.append(cur)
    # INFO, STATE_GET and STATE_META ignore their payload: skipped, never handed out.
    assert bodies == [b"" if op in NO_PAYLOAD_OPS else p for op, *_, p in reqs]


def test_oversized_payload_is_skipped_and_stream_stays_in_sync():
    lim = Limits(max_payload={Op.CONFIGURE: 10}, default_max_payload=0)
    dec = RequestDecoder(lim)
    dec.feed(encode_request(Op.CONFIGURE, b"0", b"x" * 100) + encode_request(Op.INFO, b"1"))
    with pytest.raises(FrameTooLarge) as ei:
        dec.next_event()
    assert ei.value.rule == "req.payload_len" and ei.value.header.payload_len == 100 and ei.value.recoverable
    assert "exceeds the CONFIGURE limit of 10 bytes" in str(ei.value)
    evs = list(dec.events())
    assert evs[0] == RequestEnd(skipped=True)
    assert isinstance(evs[1], RequestStart) and evs[1].key == b"1"
    assert evs[2] == RequestEnd()


def test_ignored_payload_is_skipped_after_the_start():
    dec = RequestDecoder(Limits())
    dec.feed(encode_request(Op.STATE_META, b"0", b"z" * 5000) + encode_request(Op.INFO))
    evs = list(dec.events())
    assert evs[0].header.payload_len == 5000 and evs[0].payload_len == 0
    assert evs[1] == RequestEnd(skipped=True) and evs[2].header.op == Op.INFO and evs[3] == RequestEnd()


@pytest.mark.parametrize("op", [Op.CONFIGURE, Op.INFO])
def test_more_than_max_drain_left_is_final_and_allocates_nothing(op):
    dec = RequestDecoder(Limits(max_drain=1000))
    dec.feed(encode_request_header(op, 0, 1 << 40, 0) + b"{}")
    for _ in range(2):
        with pytest.raises(FrameTooLarge) as ei:
            dec.next_event()
        assert not ei.value.recoverable and ei.value.header.payload_len == 1 << 40
    assert dec.buffered == 0


def test_skip_payload_is_bounded_by_max_drain():
    dec = RequestDecoder(Limits(max_drain=10, buffer_threshold=4))
    dec.feed(encode_request(Op.PREFILL, b"0", b"y" * 30))
    assert isinstance(dec.next_event(), RequestStart)
    assert dec.next_event() == PayloadChunk(b"y" * 30)
    dec2 = RequestDecoder(Limits(max_drain=10, buffer_threshold=4))
    dec2.feed(encode_request_header(Op.PREFILL, 1, 30, 0) + b"0" + b"y" * 5)
    dec2.next_event()
    assert dec2.next_event() == PayloadChunk(b"y" * 5)
    with pytest.raises(FrameTooLarge) as ei:
        dec2.skip_payload()
    assert not ei.value.recoverable and ei.value.rule == "req.drain"


def test_receive_into_lands_payload_in_the_destination_and_never_past_it():
    payload = bytes(range(200))
    dest = bytearray(150)
    dec2 = RequestDecoder(Limits(buffer_threshold=4))
    dec2.feed(encode_request_header(Op.STATE_PUT, 1, 200, 0) + b"0" + payload[:30])
    assert isinstance(dec2.next_event(), RequestStart)
    assert dec2.receive_into(memoryview(dest)) == 30 and dec2.receiving == 120
    room = dec2.get_buffer(1 << 20)
    assert len(room) == 120  # only the destination's rest: the transport cannot read past it
    room[:] = payload[30:150]
    dec2.buffer_updated(120)
    assert dest == payload[:150] and dec2.receiving == 0 and dec2.payload_remaining == 50
    assert dec2.wanted == 50
    dec2.feed(payload[150:] + encode_request(Op.INFO))
    assert dec2.next_event() == PayloadChunk(payload[150:])
    assert dec2.next_event() == RequestEnd() and dec2.next_event().header.op == Op.INFO


def test_wanted_never_reads_past_the_part_awaited():
    meta, payload = b'{"a":1}', b"p" * 10
    stream = encode_response(Status.OK, meta, payload) + encode_response(Status.OK)
    dec, events, pos, ends = ResponseDecoder(), [], 0, []
    while pos < len(stream):
        n = dec.wanted or 1
        dec.feed(stream[pos:pos + n])
        pos += n
        for ev in dec.events():
            events.append(ev)
            ends.append(pos)  # where the stream stood when the event came out
    assert [type(e) for e in events] == [ResponseStart, PayloadChunk, ResponseEnd, ResponseStart, ResponseEnd]
    # the head came out with nothing of the payload read: a caller can read the payload itself
    assert ends[0] == 12 + len(meta) and ends[1] == ends[2] == 12 + len(meta) + len(payload)


def test_bad_magic_is_final():
    dec = RequestDecoder()
    dec.feed(b"\x48\x59" + bytes(14))
    for _ in range(2):
        with pytest.raises(BadMagic):
            dec.next_event()


@settings(max_examples=60)
@given(st.sampled_from(list(Status)), st.binary(max_size=50), st.binary(max_size=2000), st.data())
def test_response_decoder_split_invariance(status, meta, payload, data):
    stream = encode_response(status, meta, payload) * 2
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    pieces = [stream[a:b] for a, b in zip([0] + cuts, cuts + [len(stream)])]
    evs = _coalesce(_drain(ResponseDecoder(Limits(buffer_threshold=100)), pieces))
    one = [ResponseStart(decode_response_header(stream[:12]), meta)]
    if payload:
        one.append(PayloadChunk(payload))
    one.append(ResponseEnd())
    assert evs == one * 2


@settings(max_examples=200)
@given(st.binary(max_size=400))
def test_garbage_never_raises_foreign_errors(raw):
    for dec in (RequestDecoder(), ResponseDecoder()):
        try:
            dec.feed(raw)
            for _ in range(50):
                try:
                    if dec.next_event() is NEED_DATA:
                        break
                except FrameTooLarge:
                    continue
        except CodecError:
            pass


@given(st.integers(0, 0xFF), st.integers(0, 0xFFFF), st.integers(0, 2**64 - 1), st.integers(0, 0xFFFF),
       st.integers(0, 0xFF))
def test_unchecked_header_packer_equals_the_construct_layout(op, key_len, payload_len, trace_len, flags):
    raw = pack_request_header_unchecked(op, key_len, payload_len, trace_len, flags)
    assert raw == REQUEST_HEADER.build(dict(magic=0x4859, op=op, flags=flags, key_len=key_len,
                                            payload_len=payload_len, trace_len=trace_len))
    assert raw == encode_request_header(op, key_len, payload_len, trace_len, flags)
    # out-of-range values are cut to the field width instead of refused
    assert pack_request_header_unchecked(op | 0x100, key_len | 0x10000, payload_len, trace_len, flags) == raw
