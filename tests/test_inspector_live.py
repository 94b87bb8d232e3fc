"""``hydra-rpc inspect`` following live traffic: a pcap piped in is decoded as its packets
arrive (not at EOF), ``-i IFACE`` captures through real tcpdump, times stay capture-relative
under ``-Y``, and ``-T fields -e …`` prints columns like tshark."""
from __future__ import annotations

import contextlib
import io
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from codec.enums import Op, Status
from codec.framing import RESPONSE_HEADER_SIZE, encode_request, encode_response
from tools.inspector.live import NoCaptureTool, capture_command, capture_filter
from tools.inspector.pcap_io import PcapWriter

CLIENT, SERVER = ("10.0.0.1", 40000), ("10.0.0.2", 9503)
INSPECT = [sys.executable, "-m", "hydra_rpc.cli", "inspect"]


def _capture() -> tuple[bytes, list[int]]:
    """A pcap of INFO, STATE_META key 7 (NOT_FOUND) and INFO with a tab in its key, and the file
    offset after each packet. The first packet (the SYN) is at t=10.0."""
    f = io.BytesIO()
    ends: list[int] = []
    w = PcapWriter(f)
    w.open(0, CLIENT, SERVER, 10.0)
    ends += [f.tell()] * 3
    for i, (req, resp) in enumerate([
            (encode_request(Op.INFO, b"", b"", b"t1"), encode_response(Status.OK, b'{"engine":"x"}')),
            (encode_request(Op.STATE_META, b"7"), encode_response(Status.NOT_FOUND, b'{"error":"no slot 7"}')),
            (encode_request(Op.INFO, b"a\tb"), encode_response(Status.OK, b'{"engine":"y"}'))]):
        w.data(0, "c2s", req, 11.0 + i)
        ends.append(f.tell())
        w.data(0, "s2c", resp, 11.25 + i)
        ends.append(f.tell())
    w.fin(0, "c2s", 14.0)
    w.fin(0, "s2c", 14.0)
    return f.getvalue(), ends


class Lines:
    """A child's stdout lines, read by a thread, waited for with a deadline."""

    def __init__(self, proc: subprocess.Popen, pipe=None):
        self.q: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        pipe = proc.stdout if pipe is None else pipe
        pump = lambda: [self.q.put(ln.decode()) for ln in iter(pipe.readline, b"")]  # noqa: E731
        threading.Thread(target=pump, daemon=True).start()

    def drained(self) -> str:
        """Every line read so far that ``next`` has not returned."""
        rest = []
        while not self.q.empty():
            rest.append(self.q.get_nowait())
        return "".join(rest)

    def next(self, timeout: float = 20.0) -> str:
        try:
            line = self.q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line within {timeout}s; so far: {self.seen}") from None
        self.seen.append(line)
        return line


def test_stdin_is_decoded_as_the_capture_arrives_not_at_eof():
    data, ends = _capture()
    with subprocess.Popen([*INSPECT, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as p, _killed(p):
        lines = Lines(p)
        cut = ends[4] + 7  # the first exchange whole, then 7 bytes into the next packet's record
        for piece in (data[:5], data[5:ends[3] - 3], data[ends[3] - 3:cut]):  # the pcap header split too
            p.stdin.write(piece)
            p.stdin.flush()
        first, second = lines.next(), lines.next()
        assert re.search(r"\bINFO\b", first) and "→" in first, first
        assert " OK INFO" in second and "←" in second, second
        assert p.poll() is None  # still reading: the rest has not been written
        p.stdin.write(data[cut:])
        p.stdin.close()
        rest = [lines.next() for _ in range(4)]
        assert "STATE_META" in rest[0] and "NOT_FOUND" in rest[1], rest
        assert p.wait(60) == 0, p.stderr.read()


@contextlib.contextmanager
def _killed(p: subprocess.Popen):
    """Kill ``p`` if the test failed with it still running (Popen's own exit would wait)."""
    try:
        yield
    finally:
        if p.poll() is None:
            p.kill()


def _inspect(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*INSPECT, str(path), *args], capture_output=True, text=True, timeout=60)


def test_times_stay_capture_relative_under_a_filter(tmp_path):
    cap = tmp_path / "cap.pcap"
    cap.write_bytes(_capture()[0])
    r = _inspect(cap, "-Y", "op == STATE_META")
    assert r.returncode == 0, r.stderr
    times = [float(line.split()[1]) for line in r.stdout.splitlines()]
    assert times == [2.0, 2.25]  # sent at 12.0 and 12.25; the capture starts at 10.0 (tshark's time_relative)


def test_fields_output_like_tshark(tmp_path):
    cap = tmp_path / "cap.pcap"
    cap.write_bytes(_capture()[0])
    r = _inspect(cap, "-T", "fields", "-e", "number", "-e", "time", "-e", "direction", "-e", "op", "-e", "status",
                 "-e", "key", "-e", "hydra.meta_len", "-Y", "direction == response")
    assert r.returncode == 0, r.stderr
    rows = [line.split("\t") for line in r.stdout.splitlines()]
    assert [row[1:6] for row in rows] == [["1.250000", "response", "INFO", "OK", ""],
                                          ["2.250000", "response", "STATE_META", "NOT_FOUND", "7"],
                                          ["3.250000", "response", "INFO", "OK", "a\\tb"]]  # a tab stays one column
    assert all(len(row) == 7 for row in rows)
    bad = _inspect(cap, "-T", "fields", "-e", "nope")
    assert bad.returncode == 2 and "unknown field 'nope'" in bad.stderr
    assert _inspect(cap, "-T", "fields").returncode == 2


def test_capture_command_prefers_tcpdump_and_says_what_to_install():
    assert capture_filter([9503, 8080]) == "tcp and (port 8080 or port 9503)"
    assert capture_command("lo", [], which=lambda t: f"/usr/bin/{t}")[:6] == ["tcpdump", "-i", "lo", "-U", "-s", "0"]
    assert capture_command("lo", [1], which=lambda t: t if t == "dumpcap" else None)[0] == "dumpcap"
    with pytest.raises(NoCaptureTool, match="apt-get install tcpdump"):
        capture_command("lo", [], which=lambda t: None)


def _hydra_like_server() -> tuple[socket.socket, int]:
    """Answers every INFO request with OK (enough for a capture to hold real Hydra traffic)."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                while conn.recv(64 * 1024):
                    conn.sendall(encode_response(Status.OK, b'{"engine":"fake"}'))

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


@pytest.mark.skipif(shutil.which("tcpdump") is None or os.geteuid() != 0,
                    reason="needs tcpdump and root (scripts/install_test_tools.sh installs tcpdump)")
def test_live_interface_capture_through_tcpdump():
    srv, port = _hydra_like_server()
    with subprocess.Popen([*INSPECT, "-i", "lo", "--port", str(port)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as p, _killed(p):
        errors = Lines(p, p.stderr)  # drained to the end: a full pipe would stop the child
        ready = ""
        while "listening on lo" not in ready:  # tcpdump's own line: the capture is running
            ready += errors.next(30)
        lines = Lines(p)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(encode_request(Op.INFO, b"", b"", b"live"))
            assert len(c.recv(RESPONSE_HEADER_SIZE + 64)) >= RESPONSE_HEADER_SIZE
        request, response = lines.next(30), lines.next(30)
        assert re.search(r"\bINFO\b", request) and "OK" in response, (request, response)
        p.send_signal(signal.SIGINT)  # the deadline below only turns a hang into a failure
        try:
            rc = p.wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"inspect still running 60 s after SIGINT: {_process_tree(p.pid)}; "
                                 f"its stderr: {errors.drained()}") from None
        assert rc == 0, errors.drained()
    srv.close()


def _process_tree(pid: int) -> str:
    """``pid`` and its children with their states and what they wait in (for a hang's report)."""
    out = subprocess.run(["ps", "-o", "pid,ppid,stat,wchan:32,args", "--ppid", str(pid), "-p", str(pid)],
                         capture_output=True, text=True, timeout=10)
    return out.stdout
