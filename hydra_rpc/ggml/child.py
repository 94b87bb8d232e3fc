"""llama.cpp's ggml RPC server (CPU) in a process of its own.

    python -m hydra_rpc.ggml.child [--host H] [--port P] [--threads N] [--sealed]

Standalone (the default) it behaves like llama.cpp's ``ggml-rpc-server``: it serves one client
at a time, forever, and prints ``HYDRA_GGML_RPC_READY host:port`` once it listens.

``--sealed`` is how ``--ggml-rpc-embedded`` runs it (hydra_rpc/ggml/children.py supervises): one
session on 127.0.0.1, then exit. Lines on stdin/stdout:

* child → ``READY <port>`` once the server listens on 127.0.0.1:<port>;
* the parent connects and completes a HELLO, then → ``seal``;
* the child shuts its listening socket down, so no one can connect any more, and answers
  ``SEALED <n>``: how many connections the server accepted. 1 means the parent's was the only
  one; anything else means someone reached the port first, and the parent discards the child.

The child exits when that session ends (the server's next accept fails on the shut listener)
or when stdin closes (the parent is gone; the kernel also sends SIGKILL then, PR_SET_PDEATHSIG).
It asks the OOM killer to take it before anything else (oom_score_adj 1000).
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import signal
import socket
import sys
import threading
import time

from engine.ggml_rpc_lib import find_free_port, start_server_blocking

READY_PREFIX = "HYDRA_GGML_RPC_READY"  # standalone: printed (and flushed) once the port listens

ACCEPTED_LINE = b"Accepted client connection"  # printed (and flushed) by the server before each session
PR_SET_PDEATHSIG = 1
PORT_TRIES = 8


def _listening_socket(port: int, server: threading.Thread, timeout: float = 10.0) -> socket.socket:
    """The server's own listening socket (a dup of its fd), found in /proc/self/fd once it listens.

    Found this way rather than by connecting: a probe connection would be the server's first client."""
    deadline = time.monotonic() + timeout
    while True:
        for name in os.listdir("/proc/self/fd"):
            try:
                if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    continue
                s = socket.socket(fileno=os.dup(int(name)))
            except OSError:
                continue
            try:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and s.getsockname()[1] == port:
                    return s
            except OSError:
                pass
            s.close()
        if not server.is_alive():
            raise OSError(f"the ggml RPC server could not listen on port {port}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ggml RPC server did not listen on port {port} within {timeout:.0f}s")
        time.sleep(0.005)


def _serve(host: str, port: int, threads: int, listening: threading.Event, on_end) -> None:
    start_server_blocking(host, port, threads)  # returns when its accept fails (sealed: the session ended)
    if listening.is_set():  # not a port it could not bind: that thread just ends, and the next port is tried
        on_end()


def _end_process() -> None:
    sys.stderr.flush()
    os._exit(0)


def start_listening(host: str, port: int, threads: int, on_end=_end_process,
                    pick=find_free_port, tries: int = PORT_TRIES) -> tuple[int, socket.socket]:
    """Start the server on ``port`` (0: a free one) and return the port and its listening socket.

    A port found free can be taken before the server binds it (another process's bind, or an
    outgoing connection's ephemeral port): a picked port is then picked again, up to ``tries``
    times. ``on_end`` runs on the server's thread once a server that listened returns."""
    for attempt in itertools.count(1):
        listening = threading.Event()
        chosen = port or pick(host)
        server = threading.Thread(target=_serve, args=(host, chosen, threads, listening, on_end), daemon=True)
        server.start()
        try:
            listener = _listening_socket(chosen, server)
        except OSError as e:  # its thread ended: it could not bind that port
            # a server alive but not listening (TimeoutError) would not be helped by a second one
            if isinstance(e, TimeoutError) or port or attempt >= tries:
                raise
            continue
        listening.set()
        return chosen, listener


def _count_accepted(fd: int) -> int:
    """Read what the server printed so far (non-blocking) and count its accepted connections."""
    os.set_blocking(fd, False)
    text = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        text += chunk
    return text.count(ACCEPTED_LINE)


def _protect_parent() -> None:
    """Best effort: die with the parent, and be the OOM killer's first choice."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:  # pragma: no cover
        pass


def run_sealed(threads: int) -> int:
    _protect_parent()
    control = os.fdopen(os.dup(1), "wb", buffering=0)
    printed, w = os.pipe()  # the server printf()s to fd 1: keep it off the control channel
    os.dup2(w, 1)
    os.close(w)
    try:
        port, listener = start_listening("127.0.0.1", 0, threads)
    except (OSError, TimeoutError) as e:
        print(f"ggml child: {e}", file=sys.stderr)
        return 3
    control.write(f"READY {port}\n".encode())
    if sys.stdin.buffer.readline() != b"seal\n":
        return 0  # the parent gave up on this child
    listener.shutdown(socket.SHUT_RDWR)  # stop listening: pending and future connections are refused
    accepted = _count_accepted(printed)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(printed)
    control.write(f"SEALED {accepted}\n".encode())
    sys.stdin.buffer.read()  # until the parent closes stdin (or the session ends: _serve exits)
    return 0


def run_standalone(host: str, port: int, threads: int) -> int:
    try:
        port, listener = start_listening(host, port, threads)
    except (OSError, TimeoutError) as e:
        print(f"cannot start the ggml RPC server on {host}:{port or 'a free port'}: {e}", file=sys.stderr)
        return 3
    listener.close()
    sys.stdout.flush()
    # one write(2), on a line of its own: llama.cpp's server printf()s to the same fd 1
    os.write(sys.stdout.fileno(), f"\n{READY_PREFIX} {host}:{port}\n".encode())
    try:
        threading.Event().wait()  # the server's thread ends the process
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hydra_rpc.ggml.child",
                                 description="llama.cpp's ggml RPC server (CPU) from the llama-cpp-python wheel.")
    ap.add_argument("--host", default="127.0.0.1", help="dotted IPv4 address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=50052, help="0 picks a free port (printed on stdout)")
    ap.add_argument("--threads", "-t", type=int, default=1)
    ap.add_argument("--sealed", action="store_true", help="one session for a supervising parent (see above)")
    args = ap.parse_args(argv)
    return run_sealed(args.threads) if args.sealed else run_standalone(args.host, args.port, args.threads)


if __name__ == "__main__":
    sys.exit(main())
