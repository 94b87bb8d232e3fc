"""Real traffic, really captured: tcpdump on loopback while a client drives every opcode against
the server (tiny model) and llama.cpp's own RPC backend talks ggml-RPC through the passthrough;
then ``hydra-rpc inspect`` (and tshark with the generated Lua dissector) must decode it.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import dpkt
import pytest

from codec import decode_v3 as V3
from codec.enums import Op, op_name, status_name
from codec.framing import encode_request
from codec.payloads import encode_e1_decode, encode_e1_tokens, encode_json_decode, encode_swap_quant
from hydra_rpc.client import HydraClient
from tests.helpers import start_server
from tools.inspector.lua_dissector import TSHARK_OPTIONS
from tools.spawn import ChildProcess, SpawnError

pytestmark = pytest.mark.capture
REPO = Path(__file__).resolve().parent.parent

GGML_CLIENT = r"""
import sys
from engine.ggml_rpc_lib import register_rpc_server
from engine.llama_backend import BatchItem, LoadedModel
register_rpc_server(sys.argv[1])
m = LoadedModel(sys.argv[2], n_ctx=128, n_seq_max=1, n_batch=32, n_gpu_layers=99)
toks = m.tokenize("hello world")
m.decode([BatchItem(0, toks, 0, True)])
s = m.make_sampler()
out = []
for i in range(3):
    t = m.sample(0, s)
    out.append(t)
    m.decode([BatchItem(0, [t], len(toks) + i, True)])
print("TOKENS", out, flush=True)
m.close()
"""


@dataclass
class Capture:
    path: Path
    log: list[tuple[str, str, str]]  # (op, key, status) as the client saw them, in order
    pin_pieces: list[bytes]
    ggml_out: str
    model: str


def _tcpdump(port: int, path: Path) -> ChildProcess:
    if shutil.which("tcpdump") is None:
        pytest.skip("tcpdump is not installed (scripts/install_test_tools.sh installs it)")
    proc = ChildProcess(["tcpdump", "-i", "lo", "-n", "-U", "-w", str(path), f"tcp port {port}"], "tcpdump")
    try:
        proc.wait_for(re.compile("listening on"), 15)
    except SpawnError as e:
        pytest.skip(f"cannot capture on loopback: {e}")
    return proc


SPLIT_AFTER = 9  # bytes of the split request's header in its first segment


async def split_header_request(port: int, path: Path) -> tuple[str, str, str]:
    """A new connection whose first segment is a partial header: the rest is sent only once the
    first part is in the capture file, so the two are separate segments. Its payload length
    (0x1337) makes those first bytes unique in the capture."""
    payload = b'{"n_predict":16' + b" " * (0x1337 - 16) + b"}"
    frame = encode_request(Op.CONFIGURE, b"", payload, b"split")
    async with await HydraClient.connect("127.0.0.1", port) as c:
        await c.send_raw(frame[:SPLIT_AFTER])
        async with asyncio.timeout(15):
            while frame[:SPLIT_AFTER] not in path.read_bytes():
                await asyncio.sleep(0.02)
        await c.send_raw(frame[SPLIT_AFTER:])
        r = await c.read_response()
    return ("CONFIGURE", "", status_name(r.status))


async def drive(port: int, path: Path) -> tuple[list[tuple[str, str, str]], list[bytes]]:
    """Every engine opcode and dialect, a few refusals, a PIN stream, a header split across
    segments, and a bad-magic connection."""
    log: list[tuple[str, str, str]] = []
    msgs = [{"role": "user", "content": "hello there"}]
    async with await HydraClient.connect("127.0.0.1", port) as c:
        async def req(op, key=b"", payload=b"", trace=b""):
            r = await c.request(op, key, payload, trace, timeout=60)
            log.append((op_name(op), key.decode(), status_name(r.status)))
            return r

        await req(Op.INFO, b"", b"", b"t-info")
        await req(Op.STATE_META, b"0")
        await req(Op.CONFIGURE, b"", b'{"n_predict":16}', b"cfg")
        await req(Op.PREFILL, b"0", json.dumps({"messages": msgs}).encode())
        state = await req(Op.STATE_GET, b"0")
        await req(Op.STATE_PUT, b"1", state.payload)
        gen = {"n_predict": 3, "sampling": {"temperature": 0}, "stop": [], "stream": False}
        await req(Op.DECODE, b"0", V3.encode_decode_v3({"generation": gen}, json.dumps(msgs).encode(), state.payload),
                  b"v3")
        await req(Op.DECODE, b"1", encode_json_decode(3, None, stream=False))
        await req(Op.PREFILL, b"2", encode_e1_tokens([1, 5, 6, 7]))
        await req(Op.DECODE, b"2", encode_e1_decode(2, [8]))
        await req(Op.SET_EXPERT_MODE, b"", b"solo")
        await req(Op.SWAP_QUANT, b"", encode_swap_quant("q4", ".*"))
        await req(Op.PIPELINE_ATTACH, b"0", b'{"peer":"127.0.0.1:1","ot_split":""}')
        await req(Op.PUT, b"obj", b"store bytes")
        await req(0x99, b"0", b"xyz")
        await req(Op.STATE_META, b"7")
        await req(Op.PREFILL, b"0", b"{not json")
    async with await HydraClient.connect("127.0.0.1", port) as c:  # PIN: pieces until the server closes
        await c.send(Op.DECODE, b"3", encode_json_decode(4, msgs))
        hdr, _ = await c.read_head()
        pieces = [p async for p in c.pin_pieces()]
        log.append(("DECODE", "3", status_name(hdr.status)))
    log.append(await split_header_request(port, path))
    r, w = await asyncio.open_connection("127.0.0.1", port)  # bad magic: closed without a reply
    w.write(b"\x48\x59not hydra at all")
    await w.drain()
    await asyncio.wait_for(r.read(), 10)
    w.close()
    await w.wait_closed()
    return log, pieces


MARKER = b"end-of-capture-marker"


def _server_closed(path: Path, server_port: int, client_port: int) -> bool:
    """Whether the capture file already holds the server's FIN on the connection from client_port
    (a half-written last packet only means: not yet)."""
    try:
        with path.open("rb") as f:
            for _, buf in dpkt.pcap.Reader(f):
                ip = dpkt.ethernet.Ethernet(buf).data
                tcp = getattr(ip, "data", None)
                if isinstance(tcp, dpkt.tcp.TCP) and tcp.sport == server_port and tcp.dport == client_port \
                        and tcp.flags & dpkt.tcp.TH_FIN:
                    return True
    except (dpkt.NeedData, dpkt.UnpackError, ValueError):
        pass
    return False


async def _marker(port: int, path: Path) -> tuple[str, str, str]:
    """One last request. tcpdump writes packets in the order the loopback saw them and may still
    hold some when it is stopped; the server's FIN on this connection comes after the marker's
    response, so once the FIN is in the file, every byte of the session before it is too."""
    async with await HydraClient.connect("127.0.0.1", port) as c:
        client_port = c.writer.get_extra_info("sockname")[1]
        r = await c.request(Op.INFO, b"", b"", MARKER, timeout=30)
    async with asyncio.timeout(15):
        while not _server_closed(path, port, client_port):
            await asyncio.sleep(0.05)
    return ("INFO", "", status_name(r.status))


@pytest.fixture(scope="module")
def capture(tmp_path_factory, tiny_model_path) -> Capture:
    path = tmp_path_factory.mktemp("cap") / "session.pcap"
    server = start_server("--model", "tiny", "--no-http", "--ggml-rpc-embedded", "--log-level", "WARNING")
    try:
        td = _tcpdump(server.port, path)
        try:
            log, pieces = asyncio.run(drive(server.port, path))
            try:
                ggml = subprocess.run([sys.executable, "-c", GGML_CLIENT, f"127.0.0.1:{server.port}",
                                       tiny_model_path], capture_output=True, text=True, timeout=60, cwd=REPO)
                ggml_out = ggml.stdout if "TOKENS" in ggml.stdout else \
                    f"ggml client failed:\n{ggml.stdout}\n{ggml.stderr[-3000:]}"
            except subprocess.TimeoutExpired as e:
                ggml_out = f"ggml client hung for 60 s:\n{e.stdout}\n{e.stderr}"
            log.append(asyncio.run(_marker(server.port, path)))
        finally:
            td.stop(signal.SIGINT, 15)
    finally:
        server.stop()
    # A failing ggml client fails the ggml test only; the Hydra part of the capture stays useful.
    return Capture(path, log, pieces, ggml_out, tiny_model_path)


def inspect(*args: str, data: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "inspect", *args], input=data, capture_output=True,
                          timeout=120, cwd=REPO, check=True)


def records(*args: str, data: bytes | None = None) -> list[dict]:
    return [json.loads(line) for line in inspect(*args, "--json", data=data).stdout.splitlines()]


def test_every_request_listed_with_op_key_status_and_its_response(capture):
    recs = records(str(capture.path))
    hydra_req = [r for r in recs if r["proto"] == "hydra" and r["direction"] == "request"]
    assert [(r["op"], r["key"], r["status"]) for r in hydra_req] == capture.log
    by_number = {r["number"]: r for r in recs}
    for r in hydra_req:
        resp = by_number[r["pair"]]
        assert resp["direction"] == "response" and resp["pair"] == r["number"] and resp["stream"] == r["stream"]
        assert resp["op"] == r["op"] and resp["latency_ms"] > 0 and resp["complete"]
    dialects = {(r["op"], r.get("dialect")) for r in hydra_req}
    assert {("DECODE", "v3"), ("DECODE", "json-frames"), ("DECODE", "e1"), ("DECODE", "pin"),
            ("PREFILL", "json"), ("PREFILL", "e1")} <= dialects
    pin = next(by_number[r["pair"]] for r in hydra_req if r.get("dialect") == "pin")
    text = next(f for f in pin["fields"] if f["name"] == "hydra.pin")["value"]["text"]
    assert text == b"".join(capture.pin_pieces).decode("utf-8", "replace")
    prefill = next(by_number[r["pair"]] for r in hydra_req if r["op"] == "PREFILL" and r["status"] == "OK"
                   and r.get("dialect") == "json")
    assert any(f["name"] == "hydra.payload" and f["children"][-1]["value"] is True for f in prefill["fields"]), \
        "kv_hash_str of the real PREFILL payload must verify"
    bad = [r for r in recs if r["proto"] == "raw"]
    assert len(bad) == 1 and "neither Hydra" in bad[0]["notes"][0]["text"]


def test_ggml_passthrough_session_decoded_with_the_negotiated_table(capture):
    assert "TOKENS" in capture.ggml_out, capture.ggml_out
    recs = records(str(capture.path))
    g = [r for r in recs if r["proto"] == "ggml"]
    assert g, "no ggml-RPC stream in the capture"
    hello = [r for r in g if r["cmd"] == "HELLO" and r["direction"] == "response"]
    assert hello and all(r["version"].count(".") == 2 for r in hello)
    cmds = {r["cmd"] for r in g if r["direction"] == "request"}
    assert {"HELLO", "ALLOC_BUFFER", "BUFFER_GET_BASE", "SET_TENSOR", "GET_TENSOR", "GET_ALLOC_SIZE"} <= cmds
    assert cmds & {"GRAPH_COMPUTE", "GRAPH_RECOMPUTE"}
    for r in g:
        assert r["complete"] and not [n for n in r["notes"] if n["severity"] != "note"], r
        if r["direction"] == "request" and r.get("answered", True):
            assert r["pair"] is not None, r["summary"]
    weights = sum(r.get("data_len", 0) for r in g if r["cmd"] == "SET_TENSOR")
    assert weights > 0.5 * os.path.getsize(capture.model)
    graph = next(r for r in g if r["cmd"] == "GRAPH_COMPUTE")
    assert graph["n_nodes"] > 0 and graph["n_tensors"] >= graph["n_nodes"]


def test_filter_stats_and_views_on_the_capture(capture):
    failing = records(str(capture.path), "-Y", "proto == hydra and direction == request and status != OK")
    assert sorted(r["op"] for r in failing) == sorted(op for op, _, st in capture.log if st != "OK")
    assert records(str(capture.path), "-Y", "op == DECODE and status != OK") == []
    stats = json.loads(inspect(str(capture.path), "--stats", "--json", "-q").stdout.splitlines()[-1])["stats"]
    info = next(o for o in stats["ops"] if o["op"] == "INFO" and o["proto"] == "hydra")
    assert info["requests"] == 2 and info["statuses"] == {"OK": 2} and info["latency_ms"]["p50"] > 0
    assert stats["bytes"]["hydra:request"] > 0 and stats["bytes"]["ggml:request"] > stats["bytes"]["ggml:response"]
    text = inspect(str(capture.path), "--stats").stdout.decode()
    assert "p95 ms" in text and "DECODE" in text
    tree = inspect(str(capture.path), "-V", "-x", "-Y", "op == STATE_PUT and direction == request").stdout.decode()
    assert "hydra.kv.n_past" in tree and "0000  59 48 31 00" in tree


def _rewrite(src: Path, keep) -> bytes:
    """The capture with packets cut or dropped, written with dpkt."""
    out = io.BytesIO()
    with open(src, "rb") as f:
        reader = dpkt.pcap.Reader(f)
        w = dpkt.pcap.Writer(out, snaplen=65535, linktype=reader.datalink())
        for i, (ts, buf) in enumerate(reader):
            pkt = keep(i, buf)
            if pkt is not None:
                w.writepkt(pkt, ts=ts)
    return out.getvalue()


def test_damaged_captures_are_explained_not_fatal(capture):
    snapped = records("-", data=_rewrite(capture.path, lambda i, b: b[:120]))
    assert any("missing from the capture" in n["text"] for r in snapped for n in r["notes"])
    requests = [r for r in snapped if r["proto"] == "hydra" and r["direction"] == "request"]
    assert [r["op"] for r in requests][:3] == ["INFO", "STATE_META", "CONFIGURE"]  # headers fit in 120 bytes
    dropped = records("-", data=_rewrite(capture.path, lambda i, b: None if i % 7 == 3 else b))
    assert dropped and any(not r["complete"] for r in dropped)


def _tshark(lua: Path, pcap: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(["tshark", "-n", *TSHARK_OPTIONS, "-X", f"lua_script:{lua}", "-r", str(pcap), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Lua: Error" not in proc.stderr, proc.stderr
    return proc


def test_tshark_with_the_generated_dissector_sees_what_inspect_sees(capture, tmp_path):
    """Requests (also one whose header is split across segments), the opcode each response
    answers, and the PIN stream's pieces: all as the client saw them, with no Lua error."""
    if shutil.which("tshark") is None:
        pytest.skip("tshark is not installed (scripts/install_test_tools.sh installs it)")
    lua = tmp_path / "hydra.lua"
    lua.write_bytes(inspect("--dissector").stdout)
    hydra_lines = [line for line in _tshark(lua, capture.path).stdout.splitlines() if " HYDRA " in line]
    assert hydra_lines and not [line for line in hydra_lines if "Malformed" in line or "out of bounds" in line]
    fields = ["hydra.direction", "hydra.op", "hydra.key", "hydra.status", "hydra.request_op", "hydra.pin.len",
              "hydra.pin.piece"]
    frames = json.loads(_tshark(lua, capture.path, "-Y", "hydra", "-T", "json",
                                *[a for f in fields for a in ("-e", f)]).stdout)
    requests, responses, piece_lens, pieces = [], [], [], []
    for fr in frames:
        layer = fr["_source"]["layers"]
        get = lambda name: layer.get(name, [])  # noqa: E731
        requests += list(zip((op_name(int(op, 16)) for op in get("hydra.op")), get("hydra.key"), strict=True))
        responses += [(op_name(int(op, 16)), status_name(int(st, 16)))
                      for op, st in zip(get("hydra.request_op"), get("hydra.status"))]
        piece_lens += [int(n) for n in get("hydra.pin.len")]
        pieces += get("hydra.pin.piece")
    assert requests == [(op, key) for op, key, _ in capture.log]
    assert responses == [(op, st) for op, _, st in capture.log]
    assert piece_lens == [len(p) for p in capture.pin_pieces]
    ascii_pieces = [(i, p.decode()) for i, p in enumerate(capture.pin_pieces)
                    if p.isascii() and p.decode().isprintable()]
    assert ascii_pieces and all(pieces[i] == text for i, text in ascii_pieces)
