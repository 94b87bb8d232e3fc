"""``GET /slots`` every INTERVAL seconds from a process of its own, until its stdin closes.

    python tools/bench/slots_poll.py HOST PORT INTERVAL

Prints ``ready`` once it runs, then, when stdin closes, one JSON line: each answer's latency in
ms, or the error that stopped it. The bench reads ``/slots`` from here rather than from its own
event loop, which at the same time parses the streams' chunks: an answer that waited there while
the client read a burst of tokens measured the client as much as the server. Blocking sockets,
a new connection each, as a monitoring probe asks (``timed_get``, which ``http_floor`` times
``/health`` with too).
"""
from __future__ import annotations

import json
import select
import socket
import sys
import time


def timed_get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, float]:
    """One ``GET path`` on a new connection, read to its end: the status code, and the seconds
    from before ``connect`` until the server's close."""
    t0 = time.perf_counter()
    with socket.create_connection((host, port), timeout=30.0) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        head = s.recv(65536)
        while s.recv(65536):
            pass
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        status = 0
    return status, time.perf_counter() - t0


def poll(host: str, port: int, interval: float) -> dict[str, object]:
    out: list[float] = []
    while True:  # one read at least, however short the work
        status, seconds = timed_get(port, "/slots", host)
        if status != 200:
            return {"error": f"/slots answered {status}", "latencies_ms": out}
        out.append(seconds * 1000)
        if select.select([sys.stdin], [], [], interval)[0]:  # stdin readable: closed, time to stop
            return {"latencies_ms": out}


def main(argv: list[str]) -> int:
    host, port, interval = argv[0], int(argv[1]), float(argv[2])
    print("ready", flush=True)
    try:
        result = poll(host, port, interval)
    except OSError as e:
        result = {"error": f"{type(e).__name__}: {e}", "latencies_ms": []}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
