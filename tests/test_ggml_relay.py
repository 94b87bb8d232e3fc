"""The passthrough relay's receive (hydra_rpc/ggml/relay.py) on real loopback sockets.

A relay thread sleeps until the session guard can decide (``SO_RCVLOWAT``). These tests start
the wait with part of the mark already queued — a relay thread looping back between a client's
command byte and the rest of its header — which is where a blocking ``recv`` slept forever.
"""
from __future__ import annotations

import platform
import select
import socket
import threading
from pathlib import Path

import pytest

from hydra_rpc.ggml.relay import recv_at_mark
from tests.helpers import wait_until

FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())


@pytest.fixture
def pair():
    with socket.create_server(("127.0.0.1", 0)) as ls:
        sender = socket.create_connection(ls.getsockname())
        receiver, _ = ls.accept()
    with sender, receiver:
        yield sender, receiver


def asleep_in_the_kernel(tid: int) -> bool:
    """The thread is blocked in a system call other than a futex (the GIL, a lock)."""
    line = Path(f"/proc/self/task/{tid}/syscall").read_text().split()
    return line[0] not in ("running", str(FUTEX))


def receive_in_thread(sock: socket.socket, mark: int) -> tuple[threading.Thread, list, list]:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    buf, got, tid = bytearray(1 << 16), [], []

    def run() -> None:
        tid.append(threading.get_native_id())
        n = recv_at_mark(sock, poller, buf)
        got.append(bytes(buf[:n]))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    wait_until(lambda: tid and asleep_in_the_kernel(tid[0]), "the receiving thread asleep in the kernel")
    return t, got, tid


@pytest.mark.skipif(FUTEX is None, reason="futex syscall number unknown on this machine")
@pytest.mark.timeout(60)
def test_a_wait_started_with_part_of_its_mark_queued_wakes_when_the_rest_arrives(pair):
    sender, receiver = pair
    sender.sendall(b"\x0f")  # the command byte is there before the wait starts
    t, got, _ = receive_in_thread(receiver, 9)
    sender.sendall(bytes(8))  # the size: now the header is whole
    t.join(20)
    assert not t.is_alive(), "the receive slept on with the whole header queued"
    assert got == [b"\x0f" + bytes(8)]


@pytest.mark.skipif(FUTEX is None, reason="futex syscall number unknown on this machine")
@pytest.mark.timeout(60)
def test_a_wait_takes_everything_queued_and_sleeps_until_its_mark(pair):
    sender, receiver = pair
    t, got, _ = receive_in_thread(receiver, 9)
    sender.sendall(b"\x0f")
    sender.sendall(bytes(4))
    # five bytes queued, below the mark: the thread must still be asleep in the kernel
    assert t.is_alive() and not got
    sender.sendall(bytes(4) + b"tail")  # the mark reached, and more
    t.join(20)
    assert got and got[0].startswith(b"\x0f" + bytes(8))


@pytest.mark.skipif(FUTEX is None, reason="futex syscall number unknown on this machine")
@pytest.mark.timeout(60)
def test_a_wait_ends_when_the_relay_stops(pair):
    _, receiver = pair
    t, got, _ = receive_in_thread(receiver, 9)
    receiver.shutdown(socket.SHUT_RDWR)  # Relay.stop() from another thread
    t.join(20)
    assert got == [b""]


@pytest.mark.timeout(60)
def test_a_wait_ends_at_eof(pair):
    sender, receiver = pair
    poller = select.poll()
    poller.register(receiver, select.POLLIN)
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 9)
    sender.sendall(b"ab")
    sender.shutdown(socket.SHUT_WR)
    buf = bytearray(64)
    assert recv_at_mark(receiver, poller, buf) == 2  # what there is, below the mark, at EOF
    assert recv_at_mark(receiver, poller, buf) == 0
