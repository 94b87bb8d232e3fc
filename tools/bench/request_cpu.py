"""Server CPU per request: sequential INFO and STATE_META round trips on one connection.

    python -m tools.bench.request_cpu [--requests 20000] [--runs 3] [--loop uvloop]

Spawns ``hydra-rpc serve --model tiny`` on 127.0.0.1 and, for each op, runs ``--runs``
batches of ``--requests`` strictly sequential requests (one in flight) from a blocking socket
client, interleaving the ops (INFO, STATE_META, INFO, …) so drift of a shared machine hits
both alike. The figure is the *server's* CPU (user + system, /proc/PID/stat) per request,
which is what the connection loop costs; the client's CPU does not count. Prints one JSON
object with every run and the medians. The clock-tick resolution (10 ms) is far below a
batch's CPU (seconds), so it does not matter.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

from codec.enums import Op
from codec.framing import RESPONSE_HEADER_SIZE, decode_response_header, encode_request

from .procs import HydraServer


def _recv_exactly(sock: socket.socket, n: int, buf: bytearray) -> None:
    buf.clear()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("server closed the connection")
        buf += chunk


def _batch(sock: socket.socket, request: bytes, n: int, echo: bool = False) -> None:
    buf = bytearray()
    for _ in range(n):
        sock.sendall(request)
        if echo:  # the echo server's answer is the request itself
            _recv_exactly(sock, len(request), buf)
            continue
        _recv_exactly(sock, RESPONSE_HEADER_SIZE, buf)
        h = decode_response_header(buf)
        if h.status != 0:
            raise RuntimeError(f"request failed with status {h.status}")
        _recv_exactly(sock, h.meta_len + h.payload_len, buf)


def cpu_per_request(host: str, port: int, server, request: bytes, n: int, echo: bool = False) -> float | None:
    """Microseconds of ``server``'s CPU (a ChildProcess) per request: ``n`` strictly sequential
    requests on one connection after a short warm-up (blocking; run it off the event loop)."""
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _batch(sock, request, min(500, n), echo)
        cpu0 = server.cpu_seconds()
        _batch(sock, request, n, echo)
        cpu1 = server.cpu_seconds()
    return None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / n * 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    args = p.parse_args(argv)
    requests = {"INFO": encode_request(Op.INFO, b"0"), "STATE_META": encode_request(Op.STATE_META, b"0")}
    runs: dict[str, list[dict[str, float]]] = {op: [] for op in requests}
    with HydraServer(["--model", "tiny", "--slots", "1", "--loop", args.loop]) as srv:
        with socket.create_connection((srv.host, srv.port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for req in requests.values():  # warm-up
                _batch(sock, req, 500)
            for _ in range(args.runs):
                for op, req in requests.items():
                    cpu0, t0 = srv.cpu_seconds(), time.perf_counter()
                    _batch(sock, req, args.requests)
                    wall, cpu = time.perf_counter() - t0, srv.cpu_seconds() - cpu0
                    runs[op].append({"server_cpu_us_per_req": cpu / args.requests * 1e6,
                                     "wall_us_per_req": wall / args.requests * 1e6})
    out = {"requests_per_run": args.requests, "loop": args.loop, "runs": runs,
           "median": {op: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]}
                      for op, rs in runs.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
