"""One ggml-RPC session relayed between its client and its upstream, on two threads.

ggml-RPC is many tiny round trips — per generated token a few SET_TENSORs, a GRAPH_RECOMPUTE
and a GET_TENSOR whose reply the client waits for — so the relay's cost is latency per hop.
Each direction is a thread asleep in ``poll`` (the GIL released while it waits) with
``SO_RCVLOWAT`` set to what the session guard (codec/ggml/guard.py) needs before it can decide —
llama.cpp sends a frame's command, size and payload as three segments, and waking for each
would triple the relay's CPU per token. It then takes what is there without sleeping again
(:func:`recv_at_mark`: a *blocking* ``recv`` with a low-water mark can sleep forever). What
arrives is checked and sent on at once with one ``sendmsg``, without an event-loop wakeup, a
callback or a copy. An approved bulk payload (a weight upload, a large GET_TENSOR reply) is
moved by ``os.splice`` through a pipe and never enters Python.

Closing: the client's half-close is passed on (the server still owes replies), and so is a
request the guard refuses — the frames before it are forwarded, then the server's side is
half-closed, as if the server itself had closed at the refused frame. The server's end, a
reply the guard refuses, an error or :meth:`stop` end the whole session: both sockets are
shut down, which wakes both threads.
"""
from __future__ import annotations

import fcntl
import logging
import os
import select
import socket
import threading
from collections.abc import Callable

from codec.ggml.guard import Refused, SessionGuard

log = logging.getLogger("hydra_rpc.passthrough")
CHUNK = 1 << 20  # recv buffer per direction
LOWAT_MAX = 64 << 10  # Linux caps SO_RCVLOWAT at half the receive buffer
SPLICE_MIN = 256 << 10  # bodies at least this large go through the pipe
PIPE_SIZE = 1 << 20
F_SETPIPE_SZ = 1031


def recv_at_mark(src: socket.socket, poller: select.poll, into: bytearray) -> int:
    """Sleep until ``src`` holds its ``SO_RCVLOWAT`` in bytes (or is at EOF or in error), then
    take all there is into ``into`` without sleeping again; the bytes taken (0: EOF).

    Not a blocking ``recv``: one that starts with part of its low-water mark already queued
    copies that part and sleeps, and Linux wakes it only once the bytes *still queued* reach the
    mark — which the rest of a frame never does. A relay thread that looped back to ``recv``
    between a client's command byte and its size slept forever with the frame in its queue
    (about one llama.cpp client run in 200; Linux 6.18). ``poll`` takes nothing, so the
    condition it sleeps on is the one it is woken by."""
    while True:
        poller.poll()
        try:
            return src.recv_into(into, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue  # woken with nothing queued after all: sleep again


def _set_lowat(sock: socket.socket, now: int, want: int) -> int:
    if want != now:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
    return want


def _send_all(sock: socket.socket, chunks: list) -> int:
    """``sendmsg`` until every chunk is out; returns the bytes sent."""
    total = sum(len(c) for c in chunks)
    while chunks:
        n = sock.sendmsg(chunks)
        while chunks and n >= len(chunks[0]):
            n -= len(chunks[0])
            chunks.pop(0)
        if chunks and n:
            chunks[0] = memoryview(chunks[0])[n:]
    return total


class Relay:
    def __init__(self, client: socket.socket, upstream: socket.socket, guard: SessionGuard, peer: str,
                 prefix: bytes, on_done: Callable[[], None]):
        self.client, self.upstream, self.guard, self.peer = client, upstream, guard, peer
        self.prefix = prefix  # bytes the dispatcher already read off the client
        self.on_done = on_done
        self.up = 0  # bytes client → upstream (written by the up thread only)
        self.down = 0  # bytes upstream → client (down thread only)
        self.refused: str | None = None
        self._left = 2
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(True,), name=f"ggml-up {peer}", daemon=True),
                         threading.Thread(target=self._run, args=(False,), name=f"ggml-down {peer}", daemon=True)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """End the session from any thread: both threads wake up and finish."""
        for s in (self.client, self.upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _run(self, up: bool) -> None:
        src, dst = (self.client, self.upstream) if up else (self.upstream, self.client)
        filt = self.guard.requests if up else self.guard.responses
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        pipe: tuple[int, int] | None = None
        poller = select.poll()
        poller.register(src, select.POLLIN)
        lowat = 1
        try:
            if up and self.prefix:
                self._forward(up, filt.feed(self.prefix), dst)
            while True:
                if filt.body_left >= SPLICE_MIN:
                    pipe = pipe or _pipe()
                    # a blocking splice sleeps on the low-water mark too: at 1, a body's last
                    # few bytes wake it however they are split
                    lowat = _set_lowat(src, lowat, 1)
                    moved = _splice(src.fileno(), dst.fileno(), filt.body_left, pipe)
                    filt.consume_body(moved)
                    self._count(up, moved)
                    if moved:
                        continue
                    break  # EOF inside the body
                # llama.cpp writes a frame's command, size and payload with separate send()s: sleep
                # until the guard can decide, not once per segment
                lowat = _set_lowat(src, lowat, min(filt.wanted, LOWAT_MAX))
                n = recv_at_mark(src, poller, buf)
                if n == 0:
                    break
                self._forward(up, filt.feed(view[:n]), dst)
            if up:  # the client is done sending; replies still owed keep flowing
                dst.shutdown(socket.SHUT_WR)
            else:
                self.stop()
        except Refused as e:
            self.refused = str(e)
            log.warning("closed ggml-RPC client %s: %s (%s; not forwarded)", self.peer, e,
                        "its request" if up else "the upstream's reply")
            if up:  # as if the server closed at the refused frame: what came before is served
                self._refuse_request(e, dst)
            else:
                self.stop()
        except OSError:
            self.stop()
        finally:
            if pipe is not None:
                os.close(pipe[0])
                os.close(pipe[1])
            with self._lock:
                self._left -= 1
                last = self._left == 0
            if last:
                self.on_done()

    def _refuse_request(self, e: Refused, dst: socket.socket) -> None:
        try:
            self._forward(True, list(e.approved), dst)
            self.client.shutdown(socket.SHUT_RD)
            dst.shutdown(socket.SHUT_WR)  # the server answers what it got, then closes: the down thread ends it all
        except OSError:
            self.stop()

    def _forward(self, up: bool, chunks: list, dst: socket.socket) -> None:
        if up and self.guard.requests.to_client:  # the HELLO reply: before anything is forwarded
            for reply in self.guard.requests.to_client:
                self.client.sendall(reply)
            self.guard.requests.to_client.clear()
        if chunks:
            self._count(up, _send_all(dst, chunks))

    def _count(self, up: bool, n: int) -> None:
        if up:
            self.up += n
        else:
            self.down += n


def _pipe() -> tuple[int, int]:
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:  # a lower /proc/sys/fs/pipe-max-size: the default 64 KiB works, in more steps
        pass
    return r, w


def _splice(src: int, dst: int, n: int, pipe: tuple[int, int]) -> int:
    """Move up to ``n`` bytes src → pipe → dst in the kernel; returns the bytes moved (0: EOF)."""
    r, w = pipe
    moved = 0
    while moved < n:
        got = os.splice(src, w, min(n - moved, PIPE_SIZE), flags=os.SPLICE_F_MOVE | os.SPLICE_F_MORE)
        if got == 0:
            break
        left = got
        while left:
            left -= os.splice(r, dst, left, flags=os.SPLICE_F_MOVE | os.SPLICE_F_MORE)
        moved += got
    return moved
