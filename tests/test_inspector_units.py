"""Inspector building blocks without a server: reassembly, dissection, filters, hex input, pcap I/O."""
from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
import tempfile

import dpkt
import pytest

from codec import ggml as G
from codec.decode_v3 import encode_decode_v3
from codec.enums import Op, Status
from codec.framing import REQUEST_HEADER, RESPONSE_HEADER, encode_request, encode_request_header, encode_response
from codec.hashing import kv_hash_str
from codec.kvblob import encode_kv_blob_header
from codec.payloads import encode_json_decode, encode_meta, encode_piece
from tools.inspector.filters import FilterError, compile_filter
from tools.inspector.hexinput import HexError, parse_hex
from tools.inspector.lua_dissector import generate
from tools.inspector.model import Message
from tools.inspector.pcap_io import PcapWriter, ReadStats, read_segments
from tools.inspector.reassembly import ACK, FIN, SYN, Reassembler, Segment, StreamData, StreamEnd, StreamGap
from tools.inspector.render import Renderer, message_json
from tools.inspector.session import Options, Session

C, S = ("10.0.0.1", 40001), ("10.0.0.2", 9503)


def run_session(c2s: list[bytes], s2c: list[bytes] | None = None, *, interleave: bool = True,
                opts: Options | None = None, syn: bool = True) -> list[Message]:
    """Feed chunks as one TCP stream (client chunk i, then server chunk i) and end it."""
    out: list[Message] = []
    s = Session(opts or Options(), out.append)
    s.open(0, C, S, syn_seen=syn)
    s2c = s2c or []
    if interleave:
        for i in range(max(len(c2s), len(s2c))):
            if i < len(c2s):
                s.data(0, "c2s", c2s[i], float(i))
            if i < len(s2c):
                s.data(0, "s2c", s2c[i], float(i) + 0.5)
    else:
        for i, d in enumerate(c2s):
            s.data(0, "c2s", d, float(i))
        for i, d in enumerate(s2c):
            s.data(0, "s2c", d, 100.0 + i)
    s.finish()
    return out


def ok(meta: dict | None = None, payload: bytes = b"", status: int = Status.OK) -> bytes:
    return encode_response(status, encode_meta(meta), payload)


# ---- reassembly ----------------------------------------------------------------------------


def seg(src, dst, seq, payload=b"", flags=ACK, ts=0.0):
    return Segment(ts, None, src, dst, seq & 0xFFFFFFFF, flags, payload)


def collect(events):
    data: dict[str, bytearray] = {"c2s": bytearray(), "s2c": bytearray()}
    gaps, ends = [], []
    for ev in events:
        if isinstance(ev, StreamData):
            data[ev.direction] += ev.data
        elif isinstance(ev, StreamGap):
            gaps.append((ev.direction, ev.offset, ev.length))
            data[ev.direction] += b"?" * ev.length
        elif isinstance(ev, StreamEnd):
            ends.append((ev.direction, ev.reason))
    return data, gaps, ends


@pytest.mark.parametrize("isn", [1000, 0xFFFFFFF0])  # the second one wraps the 32-bit sequence space
def test_reassembly_reorders_and_drops_retransmissions(isn):
    r = Reassembler()
    evs = r.add(seg(C, S, isn, flags=SYN))
    evs += r.add(seg(S, C, 5000, flags=SYN | ACK))
    base = isn + 1
    evs += r.add(seg(C, S, base + 10, b"KLMNOPQRST"))  # out of order
    evs += r.add(seg(C, S, base, b"ABCDEFGHIJ"))
    evs += r.add(seg(C, S, base + 5, b"FGHIJKL"))  # overlapping retransmission
    evs += r.add(seg(C, S, base, b"ABCDEFGHIJ"))  # full retransmission
    evs += r.add(seg(C, S, base + 20, b"UV", flags=ACK | FIN))
    evs += r.add(seg(S, C, 5001, b"ok", flags=ACK | FIN))
    evs += r.finish()
    data, gaps, ends = collect(evs)
    assert bytes(data["c2s"]) == b"ABCDEFGHIJKLMNOPQRSTUV"
    assert bytes(data["s2c"]) == b"ok"
    assert gaps == [] and ("c2s", "fin") in ends and ("s2c", "fin") in ends


def test_reassembly_reports_a_hole_that_never_fills():
    r = Reassembler()
    evs = r.add(seg(C, S, 99, flags=SYN)) + r.add(seg(C, S, 100, b"abc")) + r.add(seg(C, S, 110, b"xyz"))
    evs += r.finish()
    data, gaps, ends = collect(evs)
    assert bytes(data["c2s"]) == b"abc" + b"?" * 7 + b"xyz"
    assert gaps == [("c2s", 3, 7)] and ("c2s", "capture ended") in ends


def test_reassembly_without_syn_uses_ports_and_new_syn_starts_a_new_stream():
    r = Reassembler(server_ports={9503})
    evs = r.add(seg(S, C, 777, b"resp"))  # capture starts with a server packet
    opened = evs[0]
    assert opened.client == C and opened.server == S and not opened.syn_seen
    evs += r.add(seg(C, S, 50, b"q", flags=ACK | FIN))
    evs2 = r.add(seg(C, S, 9000, flags=SYN))
    assert evs2[-1].stream == 1  # port reuse after FIN: a new stream


# ---- Hydra dissection ----------------------------------------------------------------------


def test_every_byte_split_gives_the_same_messages():
    req = encode_request(Op.CONFIGURE, b"", b'{"n_predict":4}', b"t1") + encode_request(Op.INFO, b"0")
    resp = ok({"success": True}) + ok({"engine": "x"})
    whole = run_session([req], [resp], interleave=False)
    bytewise = run_session([bytes([b]) for b in req], [bytes([b]) for b in resp], interleave=False)
    assert [m.summary for m in whole] == [m.summary for m in bytewise]
    assert [m.attrs["op"].name for m in whole if m.direction == "request"] == ["CONFIGURE", "INFO"]
    assert whole[0].peer is whole[2] and whole[2].peer is whole[0]  # FIFO pairing
    assert whole[2].filter_values()["op"] == Op.CONFIGURE and whole[0].filter_values()["status"] == 0


def test_truncated_payload_is_explained_not_raised():
    huge = encode_request_header(Op.STATE_PUT, 1, 4 << 30, 0) + b"0" + encode_kv_blob_header(3, 1, [1]) \
        + bytes((1 << 20) - 14)
    (m,) = run_session([huge])
    assert not m.complete
    assert any("payload_len claims 4 GiB, stream ended after 1 MiB" in t for _, t in m.notes), m.notes
    kv = message_json(m)["fields"][-1]["children"][0]
    assert kv["name"] == "hydra.kv" and kv["value"]["n_past"] == 1


def test_pin_decode_response_runs_to_eof_and_lists_pieces():
    req = encode_request(Op.DECODE, b"3", encode_json_decode(3, [{"role": "user", "content": "hi"}]))
    resp = ok(None) + encode_piece(b"Hel") + encode_piece(b"lo") + encode_piece(b"")
    msgs = run_session([req], [resp[:15], resp[15:]])
    r = msgs[1]
    assert r.attrs["status"] == Status.OK and r.peer is msgs[0] and r.complete
    pin = next(f for f in r.fields if f.name == "hydra.pin")
    assert pin.value == {"pieces": 3, "text": "Hello"}
    assert [(c.value, c.offset, c.length) for c in pin.children] == [("Hel", 12, 7), ("lo", 19, 6), ("", 25, 4)]


def test_decode_v3_segments_and_hash_checks():
    prompt = json.dumps([{"role": "user", "content": "x"}]).encode()
    kv = encode_kv_blob_header(3, 2, [5, 6]) + bytes(16)
    good = encode_decode_v3({}, prompt, kv)
    bad_kv = encode_decode_v3({"kv_hash": kv_hash_str(b"other")}, prompt, kv)
    msgs = run_session([encode_request(Op.DECODE, b"0", good) + encode_request(Op.DECODE, b"0", bad_kv)])
    v = [m.filter_values() for m in msgs]
    assert v[0]["dialect"] == "v3" and v[0]["hydra.v3.kv_hash_ok"] is True and v[0]["hydra.v3.hdr_hash_ok"] is True
    assert v[1]["hydra.v3.kv_hash_ok"] is False
    assert any("kv segment hash does not match" in t for _, t in msgs[1].notes)


def test_prefill_response_kv_hash_and_logits_split():
    blob = encode_kv_blob_header(3, 3, [1, 2, 3]) + b"S" * 40 + b"L" * 16
    meta = {"n_past": 3, "state_size": 40, "logits_size": 16, "kv_hash_str": kv_hash_str(blob)}
    msgs = run_session([encode_request(Op.PREFILL, b"0", b'{"messages":[]}')], [ok(meta, blob)])
    v = msgs[1].filter_values()
    assert v["hydra.kv_hash_ok"] is True and v["hydra.kv"]["logits_len"] == 16 and v["hydra.kv"]["state_len"] == 40
    logits = next(f for f in msgs[1].walk() if f.name == "hydra.kv.logits")
    assert (logits.offset, logits.length) == (msgs[1].length - 16, 16)


def test_response_before_request_end_still_pairs():
    big = encode_request(Op.CONFIGURE, b"", b"{" * 5000)
    early = ok({"error": "too big"}, status=Status.ERROR)
    msgs = run_session([big[:100], big[100:]], [early])
    req = next(m for m in msgs if m.direction == "request")
    assert req.peer is not None and req.peer.attrs["status"] == Status.ERROR


def test_bad_magic_midstream_resyncs_to_the_next_header():
    good = encode_request(Op.INFO, b"", b"", b"after")
    msgs = run_session([encode_request(Op.INFO) + b"\x48\x59junk-junk-junk" + good])
    assert [m.proto for m in msgs] == ["hydra", "raw", "hydra"]
    assert msgs[2].attrs["trace"] == "after" and msgs[1].length == 16
    assert any("bad magic 48 59" in t for _, t in msgs[1].notes)


def test_cpp_state_get_error_text_is_shown_raw_and_decoding_resumes():
    reqs = [encode_request(Op.STATE_GET, b"9"), encode_request(Op.INFO)]
    resps = [encode_response(Status.NOT_FOUND, b"", b"") + b"invalid slot ID", ok({"engine": "e"})]
    msgs = run_session(reqs, resps, interleave=False)
    kinds = [(m.proto, m.direction, str(m.attrs.get("status", ""))) for m in msgs]
    assert kinds == [("hydra", "request", ""), ("hydra", "request", ""), ("hydra", "response", "NOT_FOUND"),
                     ("raw", "response", ""), ("hydra", "response", "OK")]
    assert "STATE_GET error text" in msgs[3].notes[0][1] and msgs[3].length == 15
    assert msgs[4].peer is msgs[1]


def test_mid_stream_capture_needs_decode_as():
    tail = b"padding-of-an-earlier-payload" + encode_request(Op.STATE_META, b"1")
    raw = run_session([tail], syn=False)
    assert [m.proto for m in raw] == ["raw"] and "--decode-as" in raw[0].notes[0][1]
    decoded = run_session([tail], syn=False, opts=Options(decode_as="hydra"))
    assert [m.proto for m in decoded] == ["raw", "hydra"] and decoded[1].attrs["key"] == "1"


# ---- ggml-RPC ------------------------------------------------------------------------------


def test_ggml_command_table_follows_hello():
    t = G.RpcTensor(id=1, type=0, ne=(4, 1, 1, 1), nb=(4, 16, 16, 16), name=b"blk.0.w")
    reqs = [G.encode_hello_request(), G.encode_request(G.Cmd.ALLOC_BUFFER, bytes(12)),
            G.encode_request(G.Cmd.SET_TENSOR, G.encode_set_tensor(t, 0, b"\1" * 16, version=(7, 0, 0))),
            G.encode_request(G.Cmd.GRAPH_COMPUTE, G.encode_graph_compute([1], [t])),
            G.encode_request(G.Cmd.GET_TENSOR, G.encode_rpc_tensor(t) + bytes(16))]
    resps = [G.encode_hello_response((7, 0, 0)), G.encode_response(bytes(16)), G.encode_response(b"\2" * 8)]
    msgs = sorted(run_session(reqs, resps, interleave=False), key=lambda m: m.ts_first)
    names = [(m.direction, str(m.attrs["cmd"])) for m in msgs]
    assert names == [("request", "HELLO"), ("request", "ALLOC_BUFFER"), ("request", "SET_TENSOR"),
                     ("request", "GRAPH_COMPUTE"), ("request", "GET_TENSOR"), ("response", "HELLO"),
                     ("response", "ALLOC_BUFFER"), ("response", "GET_TENSOR")]
    by = {str(m.attrs["cmd"]) + m.direction[:3]: m for m in msgs}
    assert by["GET_TENSORres"].peer is by["GET_TENSORreq"]  # SET_TENSOR and GRAPH_COMPUTE skipped (7.0.0)
    assert by["SET_TENSORreq"].attrs["answered"] is False and by["SET_TENSORreq"].attrs["data_len"] == 16
    assert by["GRAPH_COMPUTEreq"].filter_values()["ggml.graph.n_tensors"] == 1
    assert by["SET_TENSORreq"].filter_values()["ggml.tensor"]["name"] == "blk.0.w"
    assert by["HELLOres"].filter_values()["ggml.hello.version"] == "7.0.0"


def test_ggml_unsolicited_response_is_shown_raw():
    msgs = run_session([G.encode_hello_request()], [G.encode_hello_response((4, 0, 0)) + G.encode_response(b"x")],
                       interleave=False)
    assert msgs[-1].proto == "raw" and "no request awaiting" in msgs[-1].notes[0][1]


# ---- filters -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sample():
    reqs = [encode_request(Op.DECODE, b"0", b'{"n_predict":1,"stream":false}', b"bench-1"),
            encode_request(Op.STATE_META, b"7")]
    resps = [ok({"error": "slot is busy"}, status=Status.BUSY), ok({"error": "invalid slot"}, status=Status.NOT_FOUND)]
    return run_session(reqs, resps, interleave=True)


@pytest.mark.parametrize("expr, numbers", [
    ("op == DECODE and status != OK", [0, 1]),
    ("op == 0x43", [0, 1]),
    ("op in {STATE_META, INFO} && direction == response", [3]),
    ("status == busy", [0, 1]),
    ("not (op == DECODE) or key == 7", [2, 3]),
    ("trace contains \"bench\"", [0, 1]),
    ("hydra.meta.error matches 'slot .* busy'", [1]),
    ("size >= 0.03KiB and direction == request", [0]),
    ("hydra.json.stream == false", [0]),
    ("latency", [0, 1, 2, 3]),
    ("hydra.nosuchfield != 3", []),
])
def test_filters(sample, expr, numbers):
    match = compile_filter(expr)
    assert [i for i, m in enumerate(sample) if match(m.filter_values())] == numbers


@pytest.mark.parametrize("bad", ["op ==", "(op == DECODE", "op == DECODE extra", "== 3", "x matches '('",
                                 "op in {DECODE", "op ! 3", "@", "nosuchfield != 3", "op == FOO",
                                 "direction == reply", "status in {OK NOPE}", "tcp.port == 1"])
def test_bad_filters_raise_filter_error(bad):
    with pytest.raises(FilterError):
        compile_filter(bad)


# ---- hex input, Lua, pcap, CLI ---------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "5948410000000000",
    "59 48 41 00 00 00 00 00",
    "0x59, 0x48, 0x41, 0x00, 0x00, 0x00, 0x00, 0x00",
    "59:48:41:00:00:00:00:00",
    "b'YHA\\x00\\x00\\x00\\x00\\x00'",
    "00000000  59 48 41 00 00 00 00 00                          |YHA.....|",
    "00000000: 5948 4100 0000 0000                      YHA.....",
])
def test_hex_formats(text):
    assert parse_hex(text) == bytes.fromhex("5948410000000000")


def test_hex_rejects_non_hex():
    with pytest.raises(HexError):
        parse_hex("59 48 zz")


def test_lua_dissector_is_generated_from_the_construct_headers():
    lua = generate()
    for layout in (REQUEST_HEADER, RESPONSE_HEADER):
        for sc in layout.subcons:
            assert f'"hydra.{sc.name}"' in lua, sc.name
    assert "[0x43] = \"DECODE\"" in lua and "[6] = \"NOT_IMPLEMENTED\"" in lua
    assert "DESEGMENT_ONE_MORE_SEGMENT" in lua and "desegment_len" in lua and "register_heuristic" in lua


def test_pcap_writer_round_trip_and_gzip():
    buf = io.BytesIO()
    w = PcapWriter(buf)
    w.open(0, C, S, 1.0)
    w.data(0, "c2s", encode_request(Op.INFO, b"", b"", b"x" * 40000), 1.1)  # > one segment
    w.data(0, "s2c", ok({"engine": "e"}), 1.2)
    w.fin(0, "c2s", 1.3)
    w.fin(0, "s2c", 1.3)
    raw = buf.getvalue()
    ng = io.BytesIO()
    ngw = dpkt.pcapng.Writer(ng, snaplen=65535, linktype=dpkt.pcap.DLT_EN10MB)
    for ts, pkt in dpkt.pcap.Reader(io.BytesIO(raw)):
        ngw.writepkt(pkt, ts=ts)
    for data in (raw, gzip.compress(raw), ng.getvalue()):
        # stdin is decoded live: the request is shown before its response exists (as in the tap)
        proc = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "inspect", "-", "--json"], input=data,
                              capture_output=True, timeout=60, check=True)
        recs = [json.loads(line) for line in proc.stdout.splitlines()]
        assert [(r["direction"], r.get("op"), r.get("status")) for r in recs] == [
            ("request", "INFO", None), ("response", "INFO", "OK")]
        assert recs[0]["trace"] == "x" * 40000 and recs[1]["pair"] == 1 and recs[1]["latency_ms"] > 0
    with tempfile.NamedTemporaryFile(suffix=".pcap") as f:  # a file is read whole: the request has its status
        f.write(raw)
        f.flush()
        proc = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "inspect", f.name, "--json"],
                              capture_output=True, timeout=60, check=True)
    recs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["direction"], r.get("op"), r.get("status")) for r in recs] == [
        ("request", "INFO", "OK"), ("response", "INFO", "OK")]
    assert recs[0]["pair"] == 2 and recs[1]["latency_ms"] > 0
    stats = ReadStats()
    assert len(list(read_segments(io.BytesIO(raw), stats))) == stats.tcp == 8  # 3 handshake, 3 data, 2 FIN


def test_cli_hex_mode_json_has_offsets_and_filter():
    data = (encode_request(Op.STATE_META, b"0") + encode_request(Op.INFO, b"", b"", b"tr")).hex(" ")
    proc = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "inspect", "--hex", "--json", "-Y", "op == INFO"],
                          input=data, capture_output=True, text=True, timeout=60, check=True)
    (rec,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert rec["op"] == "INFO" and rec["op_code"] == 0x41 and rec["stream_offset"] == 17
    trace = next(f for f in rec["fields"] if f["name"] == "hydra.trace")
    assert (trace["value"], trace["offset"], trace["length"]) == ("tr", 16, 2)


def test_cli_rejects_bad_filter_and_non_capture_input(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "inspect", "-Y", "op ==", "--hex"], input="",
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "bad filter" in bad.stderr
    junk = tmp_path / "junk.pcap"
    junk.write_bytes(b"not a capture at all")
    proc = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "inspect", str(junk)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "not a pcap or pcapng" in proc.stderr


def test_renderer_returns_strings_without_colour_by_default(sample):
    r = Renderer()
    text = r.summary(sample[0]) + r.tree(sample[1]) + r.hexdump(sample[0])
    assert "\x1b[" not in text and "DECODE" in text and "0000  59 48 43 00" in text
    assert "\x1b[31m" in Renderer(colour=True).summary(sample[1])  # a BUSY response in red


def test_filter_help_is_user_documentation_and_bad_values_are_errors():
    run = lambda *a: subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "inspect", "--hex", *a],  # noqa: E731
                                    input="59 48 41 00", capture_output=True, text=True, timeout=60)
    helptext = run("-Y", "help").stdout
    assert helptext.startswith("hydra-rpc inspect -Y FILTER") and "Examples" in helptext and "::" not in helptext
    from tools.inspector.filters import FIELDS
    assert all(f"  {name} " in helptext for name in FIELDS)
    for bad, says in (("op == FOO", "op is never 'FOO'"), ("opp == DECODE", "unknown field 'opp'")):
        p = run("-Y", bad)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and says in p.stderr, p.stderr
