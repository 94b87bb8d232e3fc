"""ggml-RPC (docs/ggml.md): golden HELLO bytes, version table, layouts, decoders."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codec import ggml
from codec.errors import CodecError, FrameTooLarge, LocalProtocolError, MalformedPayload, RemoteProtocolError, Truncated
from codec.ggml import (
    RPC_TENSOR,
    Cmd,
    GgmlRequestDecoder,
    GgmlResponseDecoder,
    HelloResponse,
    PayloadChunk,
    RequestComplete,
    RequestHeader,
    ResponseComplete,
    ResponseHeader,
    RpcTensor,
    classify_first_bytes,
    classify_ggml_hello,
    command_name,
    command_table,
    encode_graph_compute,
    encode_hello_request,
    encode_hello_response,
    encode_request,
    encode_response,
    encode_rpc_tensor,
    encode_set_tensor,
    layout_fields,
    parse_graph_compute,
    parse_graph_compute_construct,
    parse_hello_request,
    parse_hello_response,
    parse_request_payload,
    parse_response_payload,
    parse_rpc_tensor,
    parse_rpc_tensor_construct,
    parse_set_tensor_header,
    parse_set_tensor_header_construct,
    set_tensor_header_size,
)
from tests.helpers import outcome

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
I32 = st.integers(-(2**31), 2**31 - 1)
tensors = st.builds(
    RpcTensor,
    id=U64, type=U32, buffer=U64, ne=st.tuples(U32, U32, U32, U32), nb=st.tuples(U32, U32, U32, U32), op=U32,
    op_params=st.tuples(*[I32] * 16), flags=I32, src=st.tuples(*[U64] * 10), view_src=U64, view_offs=U64,
    data=U64, name=st.binary(min_size=64, max_size=64), use_count=I32,
)


# ---- golden vectors --------------------------------------------------------------------------


def test_hello_request_golden() -> None:
    assert encode_hello_request() == bytes.fromhex("0E 18 00 00 00 00 00 00 00") + bytes(24)
    assert encode_hello_request(legacy=True) == bytes.fromhex("0E 00 00 00 00 00 00 00 00")
    assert parse_hello_request(bytes(24)) == bytes(24) and parse_hello_request(b"") is None


def test_hello_response_golden() -> None:
    caps = bytes(range(24))
    wire = encode_hello_response((4, 0, 3), caps)
    assert wire == bytes.fromhex("1C 00 00 00 00 00 00 00") + bytes((4, 0, 3, 0)) + caps
    assert parse_hello_response(wire[8:]) == HelloResponse((4, 0, 3), caps)
    legacy = encode_hello_response((3, 6, 1))
    assert legacy == bytes.fromhex("03 00 00 00 00 00 00 00 03 06 01")
    assert parse_hello_response(legacy[8:]) == HelloResponse((3, 6, 1), None)
    for bad in (b"", bytes(27), bytes(4)):
        with pytest.raises(MalformedPayload) as e:
            parse_hello_response(bad)
        assert e.value.rule == "ggml.hello_size"
    with pytest.raises(MalformedPayload):
        parse_hello_request(bytes(23))
    with pytest.raises(LocalProtocolError):
        encode_hello_request(bytes(5))


# ---- command table ------------------------------------------------------------------------


def answered(version, cmd, fork=None) -> bool | None:
    info = command_table(version, fork).get(cmd)
    return None if info is None else info.has_response


@pytest.mark.parametrize(
    ("cmd", "answered_until", "gone_at"),
    [
        (Cmd.SET_TENSOR, (1, 9, 9), (2, 0, 0)),
        (Cmd.GRAPH_COMPUTE, (3, 0, 0), (3, 5, 0)),
        (Cmd.FREE_BUFFER, (5, 1, 0), (6, 0, 0)),
        (Cmd.BUFFER_CLEAR, (5, 1, 0), (6, 0, 0)),
        (Cmd.INIT_TENSOR, (5, 1, 0), (6, 0, 0)),
        (Cmd.MEMSET_TENSOR, (5, 0, 0), (6, 0, 0)),
    ],
)
def test_responses_disappear_at_the_documented_versions(cmd: int, answered_until, gone_at) -> None:
    assert answered(answered_until, cmd) is True
    assert answered(gone_at, cmd) is False
    assert answered((7, 0, 1), cmd) is False


def test_command_presence_by_version() -> None:
    assert Cmd.HELLO not in command_table(None) and answered((1,), Cmd.HELLO)
    assert all(i.has_response for i in command_table(None).values())  # v0: everything answered
    assert Cmd.DEVICE_COUNT not in command_table((2, 0, 0)) and answered((3,), Cmd.DEVICE_COUNT)
    assert Cmd.GRAPH_RECOMPUTE not in command_table((3, 0, 0)) and answered((3, 5), Cmd.GRAPH_RECOMPUTE) is False
    assert Cmd.MEMSET_TENSOR not in command_table((4, 0, 3))
    assert Cmd.GET_DEVICE_SUPPORTS_OP not in command_table((7, 0, 0)) and answered((7, 0, 1), Cmd.GET_DEVICE_SUPPORTS_OP)
    assert Cmd.NONE not in command_table((7, 0, 1))
    assert command_name(14, (4,)) == "HELLO" and command_name(0x30, (4,)) == "0x30"


def test_request_and_response_sizes_by_version() -> None:
    def sizes(v, cmd):
        i = command_table(v)[cmd]
        return i.request_size, i.response_size

    assert sizes((2,), Cmd.ALLOC_BUFFER) == (8, 16) and sizes((3,), Cmd.ALLOC_BUFFER) == (12, 16)
    assert sizes((2,), Cmd.GET_ALIGNMENT) == (0, 8) and sizes((3,), Cmd.GET_ALIGNMENT) == (4, 8)
    assert sizes((2,), Cmd.GET_ALLOC_SIZE)[0] == 296
    assert sizes((3, 5), Cmd.GET_ALLOC_SIZE)[0] == 300 and sizes((3, 6), Cmd.GET_ALLOC_SIZE)[0] == 3260
    assert sizes((3, 6, 1), Cmd.HELLO) == (0, 3) and sizes((4,), Cmd.HELLO) == (24, 28)
    assert sizes((4,), Cmd.GET_TENSOR) == (312, None) and sizes((4,), Cmd.COPY_TENSOR) == (592, 1)
    assert sizes((5,), Cmd.MEMSET_TENSOR) == (313, 0) and sizes((7, 0, 1), Cmd.GET_DEVICE_SUPPORTS_OP) == (3260, 1)
    assert sizes((4,), Cmd.SET_TENSOR) == (None, None) and sizes((1,), Cmd.SET_TENSOR) == (None, 0)
    assert sizes((3,), Cmd.GRAPH_COMPUTE) == (None, 1)


def test_fork_tables() -> None:
    hydra = command_table((4, 1, 0), "ddvnguyen")
    assert hydra[17].name == "RESOLVE_TENSOR" and (hydra[17].request_size, hydra[17].response_size) == (64, 65)
    assert command_table((4, 1, 0), "hydra") is hydra
    box = command_table((3, 0, 0), "llama-box")
    assert box[15].name == "SUPPORT_OP" and all(i.has_response for i in box.values())
    with pytest.raises(LocalProtocolError):
        command_table((4,), "nope")
    with pytest.raises(LocalProtocolError):
        command_table((256,))


# ---- rpc_tensor -------------------------------------------------------------------------------


def test_rpc_tensor_offsets_match_the_reference_table() -> None:
    got = {name: (off, size) for name, off, size in layout_fields(RPC_TENSOR)}
    assert got == {
        "id": (0, 8), "type": (8, 4), "buffer": (12, 8), "ne": (20, 16), "nb": (36, 16), "op": (52, 4),
        "op_params": (56, 64), "flags": (120, 4), "src": (124, 80), "view_src": (204, 8), "view_offs": (212, 8),
        "data": (220, 8), "name": (228, 64), "use_count": (292, 4),
    }


@given(tensors)
def test_rpc_tensor_round_trip(t: RpcTensor) -> None:
    data = encode_rpc_tensor(t)
    assert len(data) == 296 and parse_rpc_tensor(data) == t == parse_rpc_tensor_construct(data)


def test_rpc_tensor_name() -> None:
    t = RpcTensor(name=b"blk.0.attn_q.weight".ljust(64, b"\0"))
    assert parse_rpc_tensor(encode_rpc_tensor(t)).name_str == "blk.0.attn_q.weight"


@settings(max_examples=200)
@given(st.binary(min_size=290, max_size=300), st.integers(0, 6))
def test_rpc_tensor_struct_equals_construct(data: bytes, offset: int) -> None:
    assert outcome(parse_rpc_tensor, data, offset) == outcome(parse_rpc_tensor_construct, data, offset)


# ---- GRAPH_COMPUTE ----------------------------------------------------------------------------


@settings(max_examples=50)
@given(st.lists(U64, max_size=5), st.lists(tensors, max_size=3), U32, st.sampled_from([None, (2, 0, 0), (3, 6, 1)]))
def test_graph_compute_round_trip(nodes, ts, device, version) -> None:
    payload = encode_graph_compute(nodes, ts, device=device, version=version)
    g = parse_graph_compute(payload, version)
    has_device = version is not None and version >= (3, 0, 0)
    assert g.nodes == tuple(nodes) and g.tensors == tuple(ts) and g.device == (device if has_device else None)
    assert parse_graph_compute_construct(payload, version) == g


def test_graph_compute_counts_checked_before_allocating() -> None:
    with pytest.raises(Truncated) as e:
        parse_graph_compute(struct.pack("<II", 0, 4_000_000_000) + bytes(8), (3, 0, 0))
    assert e.value.rule == "ggml.graph_nodes"
    with pytest.raises(Truncated) as e:
        parse_graph_compute(struct.pack("<III", 0, 0, 4_000_000_000) + bytes(300), (3, 0, 0))
    assert e.value.rule == "ggml.graph_tensors"
    with pytest.raises(Truncated) as e:
        parse_graph_compute(b"\x00\x00", (3, 0, 0))
    assert e.value.rule == "ggml.graph_short"
    trailing = encode_graph_compute([0], [], version=(3, 0, 0)) + b"x"
    with pytest.raises(MalformedPayload) as e:
        parse_graph_compute(trailing, (3, 0, 0))
    assert e.value.rule == "ggml.graph_trailing"
    assert parse_graph_compute(trailing, (3, 0, 0), allow_trailing=True).nodes == (0,)
    # the upstream regression case: one null node, no tensors (the server must not crash)
    assert parse_graph_compute(struct.pack("<IIQI", 0, 1, 0, 0), (3, 0, 0)).nodes == (0,)


@st.composite
def graph_payloads(draw: st.DrawFn) -> bytes:
    data = bytearray(encode_graph_compute(draw(st.lists(U64, max_size=3)), draw(st.lists(tensors, max_size=2))))
    if data and draw(st.booleans()):
        data[draw(st.integers(0, min(len(data) - 1, 40)))] = draw(st.integers(0, 3))
    if draw(st.booleans()):
        del data[draw(st.integers(0, len(data))) :]
    return bytes(data)


@settings(max_examples=200)
@given(st.binary(max_size=64) | graph_payloads(), st.sampled_from([None, (3, 6, 1)]))
def test_graph_compute_struct_equals_construct(payload: bytes, version) -> None:
    assert outcome(parse_graph_compute, payload, version) == outcome(parse_graph_compute_construct, payload, version)


# ---- SET_TENSOR ---------------------------------------------------------------------------


def test_set_tensor_header() -> None:
    t = RpcTensor(id=1, buffer=2, data=3)
    assert set_tensor_header_size((6, 0, 0)) == 304 and set_tensor_header_size((7, 0, 0)) == 305
    p6 = encode_set_tensor(t, 16, b"DATA", version=(6, 0, 0))
    h = parse_set_tensor_header(p6, version=(6, 0, 0))
    assert (h.tensor, h.cache_flag, h.offset, h.data_offset, h.data_len) == (t, None, 16, 304, 4)
    p7 = encode_set_tensor(t, 16, b"DATA", version=(7, 0, 0), cache_flag=1)
    h = parse_set_tensor_header(p7[:305], payload_size=10**10, version=(7, 0, 0))  # head of a huge upload
    assert (h.cache_flag, h.offset, h.data_len) == (1, 16, 10**10 - 305)
    with pytest.raises(MalformedPayload) as e:
        parse_set_tensor_header(p6[:300], version=(6, 0, 0))
    assert e.value.rule == "ggml.set_tensor_short"
    with pytest.raises(Truncated) as e:
        parse_set_tensor_header(p6[:100], payload_size=5000, version=(6, 0, 0))
    assert e.value.rule == "ggml.set_tensor_prefix"


@settings(max_examples=200)
@given(st.binary(min_size=290, max_size=320), st.none() | st.integers(0, 400),
       st.sampled_from([None, (6, 0, 0), (7, 0, 0)]))
def test_set_tensor_header_struct_equals_construct(prefix: bytes, payload_size, version) -> None:
    assert outcome(parse_set_tensor_header, prefix, payload_size, version) == outcome(
        parse_set_tensor_header_construct, prefix, payload_size, version)


# ---- fixed payloads by name ------------------------------------------------------------------


def test_parse_fixed_payloads() -> None:
    assert parse_request_payload(Cmd.ALLOC_BUFFER, struct.pack("<IQ", 1, 4096), (3, 0, 0)) == {"device": 1, "size": 4096}
    assert parse_request_payload(Cmd.ALLOC_BUFFER, struct.pack("<Q", 4096), (2, 0, 0)) == {"size": 4096}
    assert parse_response_payload(Cmd.GET_DEVICE_MEMORY, struct.pack("<QQ", 5, 9), (4,)) == {"free_mem": 5, "total_mem": 9}
    assert parse_response_payload(Cmd.HELLO, bytes((4, 0, 1, 0)) + bytes(24), (4,))["minor"] == 0
    assert parse_response_payload(Cmd.GET_TENSOR, b"raw") == {"data": b"raw"}
    req = parse_request_payload(Cmd.GET_TENSOR, encode_rpc_tensor(RpcTensor(id=7)) + struct.pack("<QQ", 1, 2), (4,))
    assert (req["tensor"]["id"], req["offset"], req["size"]) == (7, 1, 2)
    assert parse_request_payload(17, b"x".ljust(64, b"\0"), (4, 1, 0), "ddvnguyen")["name"][:1] == b"x"
    with pytest.raises(MalformedPayload) as e:
        parse_request_payload(Cmd.ALLOC_BUFFER, bytes(8), (3, 0, 0))
    assert e.value.rule == "ggml.request_size"
    with pytest.raises(MalformedPayload) as e:
        parse_request_payload(0x40, b"")
    assert e.value.rule == "ggml.unknown_cmd"
    g = parse_request_payload(Cmd.GRAPH_COMPUTE, encode_graph_compute([5], [], device=2), (3, 6, 1))
    assert g == {"device": 2, "nodes": [5], "tensors": []}


# ---- incremental decoders --------------------------------------------------------------------


def feed_in_pieces(decoder, wire: bytes, sizes: list[int], **kw) -> list:
    events, pos, i = [], 0, 0
    while pos < len(wire):
        step = sizes[i % len(sizes)]
        events += decoder.feed(wire[pos : pos + step], **kw)
        pos, i = pos + step, i + 1
    return events


def merged(events: list) -> list:
    """Normalise chunked payloads so any split compares equal to the whole."""
    out, acc = [], bytearray()
    for ev in events:
        if isinstance(ev, PayloadChunk):
            acc += ev.data
        elif isinstance(ev, (RequestComplete, ResponseComplete)):
            out.append((type(ev).__name__, ev.cmd, ev.size, ev.payload if ev.payload is not None else bytes(acc)))
            acc.clear()
        else:
            out.append(ev)
    return out


@settings(max_examples=100)
@given(st.lists(st.tuples(st.integers(0, 19), st.binary(max_size=40)), max_size=6),
       st.lists(st.integers(1, 13), min_size=1, max_size=8), st.integers(0, 50))
def test_request_decoder_any_split(msgs, sizes, max_buffered) -> None:
    wire = b"".join(encode_request(c, p) for c, p in msgs)
    whole = merged(GgmlRequestDecoder().feed(wire))
    dec = GgmlRequestDecoder(max_buffered=max_buffered)
    events = feed_in_pieces(dec, wire, sizes)
    dec.eof()
    assert merged(events) == whole
    assert [e for e in whole if isinstance(e, RequestHeader)] == [RequestHeader(c, len(p)) for c, p in msgs]
    big = [e for e in events if isinstance(e, RequestComplete) and e.size > max_buffered]
    assert all(e.payload is None for e in big)  # never buffered whole


def test_request_decoder_limits() -> None:
    dec = GgmlRequestDecoder(max_size=100)
    with pytest.raises(FrameTooLarge) as e:
        dec.feed(bytes((6,)) + struct.pack("<Q", 2**63))
    assert e.value.rule == "ggml.size" and e.value.recoverable is False
    dec = GgmlRequestDecoder()
    dec.feed(encode_request(1, b"abcd")[:-1])
    with pytest.raises(Truncated) as e:
        dec.eof()
    assert e.value.rule == "ggml.eof"


def test_response_decoder_fifo_skips_unanswered_commands() -> None:
    dec = GgmlResponseDecoder((4, 0, 0))
    # SET_TENSOR and GRAPH_COMPUTE get no reply at 4.0, so the first response is GET_ALIGNMENT's
    wire = encode_response(struct.pack("<Q", 32)) + encode_response(b"\x01")
    events = dec.feed(wire, [Cmd.SET_TENSOR, Cmd.GET_ALIGNMENT, Cmd.GRAPH_COMPUTE, Cmd.COPY_TENSOR])
    assert events == [
        ResponseHeader(Cmd.GET_ALIGNMENT, 8, 8), ResponseComplete(Cmd.GET_ALIGNMENT, 8, struct.pack("<Q", 32)),
        ResponseHeader(Cmd.COPY_TENSOR, 1, 1), ResponseComplete(Cmd.COPY_TENSOR, 1, b"\x01"),
    ]
    with pytest.raises(RemoteProtocolError) as e:
        dec.feed(encode_response(b""))
    assert e.value.rule == "ggml.unsolicited"


def test_response_decoder_learns_the_version_from_hello() -> None:
    dec = GgmlResponseDecoder()  # before HELLO: nothing known
    dec.expect(Cmd.HELLO)
    dec.expect(Cmd.FREE_BUFFER)  # queued before the HELLO response was seen
    dec.expect(Cmd.DEVICE_COUNT)
    events = dec.feed(encode_hello_response((6, 0, 0)) + encode_response(struct.pack("<I", 2)))
    assert dec.version == (6, 0, 0)
    assert [e.cmd for e in events if isinstance(e, ResponseComplete)] == [Cmd.HELLO, Cmd.DEVICE_COUNT]
    assert events[2] == ResponseHeader(Cmd.DEVICE_COUNT, 4, 4)


def test_response_size_mismatch_is_reported_not_raised() -> None:
    dec = GgmlResponseDecoder((4,))
    (hdr, _) = dec.feed(encode_response(b"\x00"), [Cmd.GET_ALIGNMENT])
    assert hdr.size == 1 and hdr.expected_size == 8


@given(st.binary(min_size=9, max_size=9))
def test_decoder_headers_equal_the_construct_layouts(head: bytes) -> None:
    (req_hdr, *_) = GgmlRequestDecoder().feed(head)
    c = ggml.REQUEST_HEADER.parse(head)
    assert (req_hdr.cmd, req_hdr.size) == (c.cmd, c.size)
    dec = GgmlResponseDecoder()
    (rsp_hdr, *_) = dec.feed(head[:8], [Cmd.GET_TENSOR])
    assert rsp_hdr.size == ggml.RESPONSE_HEADER.parse(head[:8]).size


@given(st.binary(max_size=30))
def test_hello_response_equals_construct(payload: bytes) -> None:
    def via_construct(p: bytes):
        version = (4, 0, 0) if len(p) == 28 else (3, 0, 0)
        d = parse_response_payload(Cmd.HELLO, p, version)
        return HelloResponse((d["major"], d["minor"], d["patch"]), d.get("conn_caps"), d.get("padding", 0))

    assert outcome(parse_hello_response, payload) == outcome(via_construct, payload)


# ---- first bytes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "kind"),
    [
        (b"\x59\x48\x30", "hydra"), (b"\x59\x48", "hydra"), (b"\x48\x59", "unknown"), (b"\x59\x00", "unknown"),
        (b"\x0e\x18", "ggml"), (b"\x0e", "ggml"), (b"\x00", "ggml_legacy"), (b"\x13", "ggml_legacy"),
        (b"\x14", "unknown"), (b"GET /", "unknown"), (b"\x16\x03", "unknown"), (b"", "incomplete"), (b"\x59", "incomplete"),
    ],
)
def test_classify_first_bytes(first: bytes, kind: str) -> None:
    assert classify_first_bytes(first) == kind


def test_classify_ggml_hello() -> None:
    assert classify_ggml_hello(encode_hello_request()[:9]) == "hello"
    assert classify_ggml_hello(encode_hello_request(legacy=True)) == "hello_legacy"
    assert classify_ggml_hello(bytes((14,)) + struct.pack("<Q", 3)) == "bad"
    assert classify_ggml_hello(b"\x0e\x18") == "incomplete" and classify_ggml_hello(b"\x01") == "bad"


# ---- garbage ---------------------------------------------------------------------------------


@settings(max_examples=300)
@given(st.binary(max_size=80), st.integers(0, 19), st.sampled_from([None, (1, 0, 0), (3, 6, 1), (4, 1, 0), (7, 0, 1)]))
def test_garbage_only_raises_codec_errors(data: bytes, cmd: int, version) -> None:
    calls = [
        lambda: parse_request_payload(cmd, data, version),
        lambda: parse_response_payload(cmd, data, version),
        lambda: parse_graph_compute(data, version),
        lambda: parse_set_tensor_header(data, version=version),
        lambda: parse_hello_request(data),
        lambda: parse_hello_response(data),
        lambda: parse_rpc_tensor(data),
        lambda: GgmlRequestDecoder(max_buffered=8, max_size=64).feed(data),
        lambda: GgmlResponseDecoder(version, max_size=64).feed(data, [cmd] * 4),
        lambda: classify_first_bytes(data),
        lambda: classify_ggml_hello(data),
    ]
    for call in calls:
        try:
            call()
        except CodecError:
            pass
