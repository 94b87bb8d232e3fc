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
    encode_request_header, encode_response, encode_response_header,
)
from codec.limits import Limits


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


@given(st.binary(min_size=16, max_size=16))
def test_request_header_struct_equals_construct(raw):
    c = REQUEST_HEADER.parse(raw)
    if c.magic != 0x4859:
        with pytest.raises(BadMagic):
            decode_request_header(raw)
        return
    h = decode_request_header(raw)
    assert (h.op, h.flags, h.key_len, h.payload_len, h.trace_len) == (
        c.op, c.flags, c.key_len, c.payload_len, c.trace_len)
    assert REQUEST_HEADER.build(dict(c)) == raw == encode_request_header(
        h.op, h.key_len, h.payload_len, h.trace_len, h.flags)


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
    assert bodies == [p for *_, p in reqs]


def test_oversized_payload_is_skipped_and_stream_stays_in_sync():
    lim = Limits(max_payload={Op.INFO: 0}, default_max_payload=0)
    dec = RequestDecoder(lim)
    dec.feed(encode_request(Op.INFO, b"0", b"x" * 100) + encode_request(Op.INFO, b"1"))
    with pytest.raises(FrameTooLarge) as ei:
        dec.next_event()
    assert ei.value.rule == "req.payload_len" and ei.value.header.payload_len == 100
    evs = list(dec.events())
    assert evs[0] == RequestEnd(skipped=True)
    assert isinstance(evs[1], RequestStart) and evs[1].key == b"1"
    assert evs[2] == RequestEnd()


def test_huge_payload_len_allocates_nothing():
    dec = RequestDecoder(Limits())
    hdr = encode_request_header(Op.CONFIGURE, 0, 1 << 40, 0)
    dec.feed(hdr + b"{}")
    with pytest.raises(FrameTooLarge):
        dec.next_event()
    assert dec.next_event() is NEED_DATA and dec.buffered == 0


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
