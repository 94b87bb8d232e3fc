"""Properties of the inspector pipeline (reassembly → session → dissectors).

1. However a conversation is cut into TCP segments — any split points, segments reordered,
   duplicated, partially retransmitted, the sequence space wrapping — it decodes to exactly the
   messages it decodes to when delivered whole.
2. Garbage never raises: random or mutated bytes, random captures, filters and hex text give
   messages with expert notes or the module's own error type, and no dissector ever fails
   (a caught dissector exception would show up as a "dissector error" note).
"""
from __future__ import annotations

import io
import json
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codec import ggml as G
from codec.decode_v3 import encode_decode_v3
from codec.enums import Op, Status
from codec.framing import encode_request, encode_response
from codec.hashing import kv_hash_str
from codec.kvblob import KvCheckpoint, encode_kv_blob_header
from codec.payloads import (encode_e1_decode, encode_json_decode, encode_meta, encode_piece, encode_token_frame)
from codec.store import encode_indexed_chunk, encode_sized_chunk
from tools.inspector.filters import FilterError, compile_filter
from tools.inspector.hexinput import HexError, parse_hex
from tools.inspector.model import Message
from tools.inspector.pcap_io import CaptureError, ReadStats, read_segments
from tools.inspector.reassembly import ACK, FIN, SYN, Reassembler, Segment
from tools.inspector.session import Options, Session

HYDRA_C, HYDRA_S = ("127.0.0.1", 50001), ("127.0.0.1", 9503)
GGML_C, GGML_S = ("127.0.0.1", 50002), ("127.0.0.1", 9503)


def ok(meta=None, payload=b"", status=Status.OK) -> bytes:
    return encode_response(status, encode_meta(meta), payload)


def hydra_conversation() -> list[tuple[bytes, bytes]]:
    """(request bytes, response bytes) per exchange; every dialect the dissector knows."""
    msgs = [{"role": "user", "content": "hello"}]
    ck = KvCheckpoint(0, 2, 3, b"tgt", b"dft!")
    blob = encode_kv_blob_header(3, 3, [1, 2, 3]) + bytes(range(64)) + b"\x00\x00\x80\x3f" * 8
    put_blob = encode_kv_blob_header(2, 3, [1, 2, 3], ck) + b"state" * 10
    kv = encode_kv_blob_header(3, 3, [1, 2, 3]) + bytes(24)
    frames = b"".join(encode_token_frame(t, -0.5, final=t == 9) for t in (7, 8, 9))
    chunks = encode_indexed_chunk(0, b"a" * 10) + encode_indexed_chunk(3, b"b" * 5)
    pieces = b"".join(encode_piece(p) for p in (b"He", b"llo", b"", "é".encode()))
    return [
        (encode_request(Op.INFO, b"", b"", b"t-1"), ok({"engine": "llama-server-hydra"})),
        (encode_request(Op.CONFIGURE, b"", b'{"n_predict":4}'), ok({"success": True, "tier": "T1"})),
        (encode_request(Op.PREFILL, b"0", json.dumps({"messages": msgs}).encode()),
         ok({"n_past": 3, "state_size": 64, "logits_size": 32, "kv_hash_str": kv_hash_str(blob)}, blob)),
        (encode_request(Op.STATE_PUT, b"1", put_blob), ok({"restored": True})),
        (encode_request(Op.DECODE, b"0", encode_decode_v3({}, json.dumps(msgs).encode(), kv), b"v3"),
         ok({"valid": True, "decode_request_id": 1})),
        (encode_request(Op.DECODE, b"2", encode_e1_decode(2, [5])), ok({"tokens_generated": 2}, b"ab")),
        (encode_request(Op.DECODE, b"1", encode_json_decode(3, None, stream=False)), ok({"n_past": 6}, frames)),
        (encode_request(Op.GET_CHUNKED, b"kv/1", b'["h1"]'), ok({"missing_count": 2}, chunks)),
        (encode_request(Op.PUSH_CHUNKS, b"kv/1", encode_sized_chunk(b"x" * 7)), ok({"stored": 1})),
        (encode_request(Op.STATE_META, b"9"), ok({"error": "invalid slot"}, status=Status.NOT_FOUND)),
        (encode_request(Op.DECODE, b"3", encode_json_decode(4, msgs)), ok(None) + pieces),  # PIN: runs to EOF
    ]


def ggml_conversation() -> list[tuple[bytes, bytes]]:
    t = G.RpcTensor(id=0x1000, type=1, buffer=0x55, ne=(8, 2, 1, 1), nb=(2, 16, 32, 32), name=b"blk.1.ffn")
    v = (7, 0, 0)
    reqs = b"".join([
        G.encode_request(G.Cmd.DEVICE_COUNT),
        G.encode_request(G.Cmd.ALLOC_BUFFER, struct.pack("<IQ", 0, 4096)),
        G.encode_request(G.Cmd.SET_TENSOR, G.encode_set_tensor(t, 0, bytes(range(32)), version=v)),
        G.encode_request(G.Cmd.GET_TENSOR, G.encode_rpc_tensor(t) + struct.pack("<QQ", 0, 32)),
        G.encode_request(G.Cmd.GRAPH_COMPUTE, G.encode_graph_compute([0x1000], [t, t])),
        G.encode_request(G.Cmd.FREE_BUFFER, struct.pack("<Q", 0x55)),
    ])
    resps = G.encode_response(struct.pack("<I", 1)) + G.encode_response(struct.pack("<QQ", 0x55, 4096)) \
        + G.encode_response(bytes(32))
    return [(G.encode_hello_request(), G.encode_hello_response(v)), (reqs, resps)]


def signature(msgs: list[Message]) -> list[tuple]:
    def one(m: Message) -> tuple:
        fields = json.dumps([f.to_json() for f in m.fields], sort_keys=True, default=repr)
        peer = (m.peer.direction, m.peer.stream_offset) if m.peer is not None else None
        return (m.src if m.direction == "request" else m.dst, m.direction, m.stream_offset, m.proto, m.length,
                m.summary, m.complete, fields, peer, tuple(m.notes))

    return sorted(one(m) for m in msgs)


def decode(segments: list[Segment]) -> list[Message]:
    out: list[Message] = []
    session = Session(Options(), out.append)
    r = Reassembler()
    for s in segments:
        for ev in r.add(s):
            session.handle(ev)
    for ev in r.finish():
        session.handle(ev)
    session.finish()
    for m in out:
        assert not any(t.startswith("dissector error") for _, t in m.notes), m.notes
    return out


class _Conn:
    """Builds the segments of one connection: handshake, data blocks, FINs."""

    def __init__(self, client, server, isn_c: int, isn_s: int):
        self.client, self.server = client, server
        self.seq = {"c2s": isn_c + 1, "s2c": isn_s + 1}
        self.isn = {"c2s": isn_c, "s2c": isn_s}

    def ends(self, d: str):
        return (self.client, self.server) if d == "c2s" else (self.server, self.client)

    def handshake(self) -> list[Segment]:
        return [Segment(0.0, None, self.client, self.server, self.isn["c2s"] & 0xFFFFFFFF, SYN, b""),
                Segment(0.0, None, self.server, self.client, self.isn["s2c"] & 0xFFFFFFFF, SYN | ACK, b"")]

    def block(self, d: str, data: bytes, pieces: list[tuple[int, int]]) -> list[Segment]:
        src, dst = self.ends(d)
        base = self.seq[d]
        self.seq[d] += len(data)
        return [Segment(0.0, None, src, dst, (base + a) & 0xFFFFFFFF, ACK, data[a:b]) for a, b in pieces]

    def fin(self, d: str) -> Segment:
        src, dst = self.ends(d)
        return Segment(0.0, None, src, dst, self.seq[d] & 0xFFFFFFFF, FIN | ACK, b"")


def whole(conn: _Conn, convo: list[tuple[bytes, bytes]]) -> list[Segment]:
    segs = conn.handshake()
    for req, resp in convo:
        segs += conn.block("c2s", req, [(0, len(req))])
        segs += conn.block("s2c", resp, [(0, len(resp))])
    return segs + [conn.fin("s2c"), conn.fin("c2s")]


@st.composite
def cut_block(draw, n: int) -> list[tuple[int, int]]:
    """Pieces of a block of ``n`` bytes: split, shuffled, some duplicated, some overlapping resends."""
    cuts = sorted(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=10, unique=True))) if n > 1 else []
    bounds = [0, *cuts, n]
    pieces = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    pieces = draw(st.permutations(pieces))
    extra = draw(st.lists(st.tuples(st.integers(0, n), st.integers(0, n)), max_size=3))
    for a, b in extra:  # retransmissions of arbitrary (possibly overlapping) ranges
        if a != b:
            pieces.insert(draw(st.integers(0, len(pieces))), (min(a, b), max(a, b)))
    return pieces


def shuffled(draw, conn: _Conn, convo: list[tuple[bytes, bytes]]) -> list[Segment]:
    segs = conn.handshake()
    for req, resp in convo:
        # Causality: a response is only sent after its request arrived, so the blocks keep their
        # order; everything inside a block may arrive in any order.
        segs += conn.block("c2s", req, draw(cut_block(len(req))))
        segs += conn.block("s2c", resp, draw(cut_block(len(resp))))
    return segs + [conn.fin("s2c"), conn.fin("c2s")]


ISN = st.one_of(st.integers(0, 2**32 - 1), st.integers(2**32 - 3000, 2**32 - 1))
REFERENCE = signature(decode(whole(_Conn(HYDRA_C, HYDRA_S, 7, 9), hydra_conversation())
                             + whole(_Conn(GGML_C, GGML_S, 7, 9), ggml_conversation())))


def test_reference_decodes_everything():
    msgs = decode(whole(_Conn(HYDRA_C, HYDRA_S, 7, 9), hydra_conversation())
                  + whole(_Conn(GGML_C, GGML_S, 7, 9), ggml_conversation()))
    hydra = [m for m in msgs if m.proto == "hydra"]
    assert len(hydra) == 2 * len(hydra_conversation()) and all(m.complete and m.peer for m in hydra)
    assert all(m.proto in ("hydra", "ggml") for m in msgs)
    assert not [n for m in msgs for n in m.notes if n[0] != "note"], [(m.summary, m.notes) for m in msgs if m.notes]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), isn=st.tuples(ISN, ISN, ISN, ISN))
def test_any_segmentation_decodes_the_same(data, isn):
    a = shuffled(data.draw, _Conn(HYDRA_C, HYDRA_S, isn[0], isn[1]), hydra_conversation())
    b = shuffled(data.draw, _Conn(GGML_C, GGML_S, isn[2], isn[3]), ggml_conversation())
    # Interleave the two connections arbitrarily, keeping each one's own order.
    picks = data.draw(st.lists(st.booleans(), min_size=len(a) + len(b), max_size=len(a) + len(b)))
    merged, ia, ib = [], 0, 0
    for p in picks:
        if (p and ia < len(a)) or ib >= len(b):
            merged.append(a[ia])
            ia += 1
        else:
            merged.append(b[ib])
            ib += 1
    assert signature(decode(merged)) == REFERENCE


def _feed_garbage(proto: str | None, chunks: list[bytes], gaps: list[int], data: bytes) -> list[Message]:
    out: list[Message] = []
    s = Session(Options(keep=1 << 16, hex_keep=256), out.append)
    s.open(0, ("a", 1), ("b", 2), proto=proto)
    for i, c in enumerate(chunks):
        direction = "c2s" if i % 2 == 0 else "s2c"
        s.data(0, direction, c, float(i))
        if i < len(gaps) and gaps[i]:
            s.gap(0, direction, gaps[i], float(i))
    s.finish()
    for m in out:
        assert not any(t.startswith("dissector error") for _, t in m.notes), (m.summary, m.notes)
        m.filter_values()
    return out


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["hydra", "ggml", None]), st.binary(max_size=3000), st.lists(st.integers(0, 3000), max_size=8),
       st.lists(st.integers(0, 40), max_size=4))
def test_random_bytes_never_raise(proto, blob, cuts, gaps):
    _feed_garbage(proto, _split(blob, cuts), gaps, blob)


def _mutate(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    b = bytearray(data)
    for pos, val in edits:
        if b:
            b[pos % len(b)] = val
    return bytes(b)


CONVOS = {"hydra": hydra_conversation(), "ggml": ggml_conversation()}


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["hydra", "ggml"]), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                                     min_size=1, max_size=6), st.lists(st.integers(0, 10**6), max_size=6))
def test_mutated_conversations_never_raise(proto, edits, cuts):
    convo = CONVOS[proto]
    req = _mutate(b"".join(r for r, _ in convo), edits[: len(edits) // 2 + 1])
    resp = _mutate(b"".join(r for _, r in convo), edits[len(edits) // 2 + 1:])
    rc, sc = _split(req, cuts), _split(resp, cuts[::-1])
    chunks = [x for pair in zip(rc + [b""] * len(sc), sc + [b""] * len(rc)) for x in pair]
    _feed_garbage(proto, chunks, [], req)


PCAP_HEADER = bytes.fromhex("d4c3b2a1020004000000000000000000ffff000001000000")


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.binary(max_size=600), st.binary(max_size=600).map(lambda b: PCAP_HEADER + b)))
def test_garbage_captures_raise_only_capture_error(blob):
    out: list[Message] = []
    session, r = Session(Options(), out.append), Reassembler()
    try:
        for seg in read_segments(io.BytesIO(blob), ReadStats()):
            for ev in r.add(seg):
                session.handle(ev)
    except CaptureError:
        pass
    for ev in r.finish():
        session.handle(ev)
    session.finish()


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_filters_raise_only_filter_error(src):
    try:
        match = compile_filter(src)
    except FilterError:
        return
    match({"op": 1, "key": "x", "hydra.meta": {"a": [1]}, "size": 3.5, "complete": True})


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789abcdefxX:|., \n\\'b-z", max_size=80))
def test_hex_parser_raises_only_hex_error(src):
    try:
        parse_hex(src)
    except HexError:
        pass
