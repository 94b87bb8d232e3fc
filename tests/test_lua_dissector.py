"""The generated Wireshark dissector under real tshark, on synthetic captures whose TCP
segmentation is chosen byte by byte: headers split across segments, pipelined requests, a
PIN stream whose pieces straddle segments, on a port nobody registered (heuristic), also when
the client's port is one another dissector registered (HTTP's 8080)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from codec.enums import Op, Status
from codec.framing import encode_request, encode_response
from codec.payloads import encode_json_decode, encode_piece
from tools.inspector.lua_dissector import TSHARK_OPTIONS, generate
from tools.inspector.pcap_io import PcapWriter

pytestmark = pytest.mark.skipif(shutil.which("tshark") is None,
                                reason="tshark is not installed (scripts/install_test_tools.sh installs it)")
CLIENT, SERVER = ("10.0.0.1", 40000), ("10.0.0.2", 40123)  # 40123: no dissector registered for it
HTTP_ALT = 8080  # tcp.port registered by HTTP, and lower than the server's: tried first by default
PIECES = ["Hel", "lo", " w\u00f6r", "ld", ""]


def _capture(path: Path, client: tuple[str, int] = CLIENT) -> None:
    t = [1.0]

    def send(direction: str, *parts: bytes) -> None:
        for part in parts:
            t[0] += 0.01
            w.data(0, direction, part, t[0])

    with open(path, "wb") as f:
        w = PcapWriter(f)
        w.open(0, client, SERVER, 1.0)
        info = encode_request(Op.INFO, b"", b"", b"tr")
        send("c2s", info[:7], info[7:])  # the connection's first segment is a partial header
        reply = encode_response(Status.OK, b'{"engine":"x"}')
        send("s2c", reply[:5], reply[5:])
        two = encode_request(Op.STATE_META, b"0") + encode_request(Op.INFO)
        send("c2s", two)  # pipelined
        replies = encode_response(Status.NOT_FOUND, b'{"error":"x"}') + encode_response(Status.OK, b'{"engine":"y"}')
        send("s2c", replies[:30], replies[30:])
        msgs = [{"role": "user", "content": "hi"}]
        send("c2s", encode_request(Op.DECODE, b"1", encode_json_decode(4, msgs), b""))
        stream = encode_response(Status.OK) + b"".join(encode_piece(p) for p in PIECES)
        send("s2c", stream[:14], stream[14:23], stream[23:])
        w.fin(0, "s2c", t[0] + 0.01)
        w.fin(0, "c2s", t[0] + 0.01)


def _tshark(tmp_path: Path, *args: str, client: tuple[str, int] = CLIENT) -> list[dict]:
    lua, pcap = tmp_path / "hydra.lua", tmp_path / "synthetic.pcap"
    lua.write_text(generate())
    _capture(pcap, client)
    fields = ["hydra.op", "hydra.key", "hydra.status", "hydra.request_op", "hydra.response_to", "hydra.pin.piece"]
    proc = subprocess.run(["tshark", "-n", *TSHARK_OPTIONS, "-X", f"lua_script:{lua}", "-r", str(pcap), *args,
                           "-Y", "hydra",
                           "-T", "json", *[a for f in fields for a in ("-e", f)]], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "Lua" not in proc.stderr, proc.stderr
    return [fr["_source"]["layers"] for fr in json.loads(proc.stdout)]


@pytest.mark.parametrize("client_port", [CLIENT[1], HTTP_ALT], ids=["unregistered-client-port", "http-client-port"])
@pytest.mark.parametrize("passes", [[], ["-2"]], ids=["one-pass", "two-pass"])
def test_split_headers_pairing_and_pin_pieces(tmp_path, passes, client_port):
    layers = _tshark(tmp_path, *passes, client=(CLIENT[0], client_port))
    requests = [(int(op, 16), key) for ly in layers for op, key in zip(ly.get("hydra.op", []), ly.get("hydra.key", []))]
    assert requests == [(Op.INFO, ""), (Op.STATE_META, "0"), (Op.INFO, ""), (Op.DECODE, "1")]
    answers = [(int(op, 16), int(st, 16), int(fr)) for ly in layers
               for op, st, fr in zip(ly.get("hydra.request_op", []), ly.get("hydra.status", []),
                                     ly.get("hydra.response_to", []))]
    assert [(op, st) for op, st, _ in answers] == [(Op.INFO, Status.OK), (Op.STATE_META, Status.NOT_FOUND),
                                                   (Op.INFO, Status.OK), (Op.DECODE, Status.OK)]
    assert len({fr for _, _, fr in answers}) == 3  # the pipelined pair was sent in one frame
    pieces = [p for ly in layers for p in ly.get("hydra.pin.piece", [])]
    assert pieces == [p for p in PIECES if p]  # an empty piece has no text field


def test_response_time_request_response_links_and_meta_tree(tmp_path):
    """hydra.time and hydra.request_in on each response, hydra.response_in on each request (a
    second pass, as HTTP's), the meta as a JSON tree; the columns stay Hydra's."""
    lua, pcap = tmp_path / "hydra.lua", tmp_path / "synthetic.pcap"
    lua.write_text(generate())
    _capture(pcap)
    fields = ["frame.number", "frame.time_relative", "hydra.op", "hydra.status", "hydra.time", "hydra.request_in",
              "hydra.response_in", "json.key", "_ws.col.Protocol"]
    proc = subprocess.run(["tshark", "-n", "-2", *TSHARK_OPTIONS, "-X", f"lua_script:{lua}", "-r", str(pcap),
                           "-Y", "hydra", "-T", "json", *[a for f in fields for a in ("-e", f)]],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "Lua" not in proc.stderr, proc.stderr
    frames = {int(ly["frame.number"][0]): ly for ly in (fr["_source"]["layers"] for fr in json.loads(proc.stdout))}
    when = {n: float(ly["frame.time_relative"][0]) for n, ly in frames.items()}
    # first response: INFO (meta {"engine":"x"}), its request is the frame of the INFO's last segment
    info_resp = next(n for n, ly in sorted(frames.items()) if ly.get("hydra.status") == ["0x00"])
    req = int(frames[info_resp]["hydra.request_in"][0])
    assert frames[req]["hydra.op"] == [f"0x{Op.INFO:02x}"]
    assert int(frames[req]["hydra.response_in"][0]) == info_resp
    assert float(frames[info_resp]["hydra.time"][0]) == pytest.approx(when[info_resp] - when[req], abs=1e-6)
    assert frames[info_resp]["json.key"] == ["engine"]
    not_found = next(ly for ly in frames.values() if ly.get("hydra.status") == [f"0x{Status.NOT_FOUND:02x}"])
    assert not_found["json.key"] == ["error"] and float(not_found["hydra.time"][0]) > 0
    assert all(ly["_ws.col.Protocol"] == ["HYDRA"] for ly in frames.values())
    # every request was answered: each has a response_in (the PIN DECODE's first response too)
    requests = [ly for ly in frames.values() if "hydra.op" in ly]
    assert requests and all("hydra.response_in" in ly for ly in requests)
