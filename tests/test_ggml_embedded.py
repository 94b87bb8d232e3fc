"""``--ggml-rpc-embedded``: llama.cpp's rpc-server in a child process per session, behind the guard.

Each crash case of issue 13 item 3 runs against one spawned server and asserts afterwards that
the server is alive and answers INFO on its Hydra port, and that a fresh ggml session still
works. The guard's rules themselves are unit-tested in tests/test_codec_ggml_guard.py.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from codec import ggml as G
from codec.enums import Op, Status
from codec.framing import encode_request as hydra_request
from engine.ggml_rpc_lib import find_free_port, hello, open_session
from hydra_rpc.ggml.child import start_listening
from hydra_rpc.ggml.children import ChildStartError, GgmlChildPool
from tests.ggml_helpers import recv_exact
from tests.helpers import start_server, wait_until
from tests.scripted_backend import until

ROOT = Path(__file__).resolve().parents[1]
V = (7, 0, 0)
MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(scope="module")
def server(tiny_model_path):
    sp = start_server("--model", "tiny", "--no-http", "--log-level", "INFO", "--ggml-rpc-embedded",
                      "--ggml-rpc-sessions", "3")
    yield sp
    assert sp.stop() == 0, sp.log[-3000:]


poll = wait_until  # this module's name for it


def assert_alive(sp) -> None:
    assert sp.proc.poll() is None, f"the server died: exit {sp.proc.returncode}\n{sp.log[-3000:]}"
    with socket.create_connection((sp.host, sp.port), timeout=10) as s:
        s.sendall(hydra_request(Op.INFO))
        assert s.recv(1) == bytes((Status.OK,))  # INFO still answered on the Hydra port
    s = session(sp)  # and a fresh ggml session is served by a fresh child
    s.sendall(G.encode_request(G.Cmd.GET_ALIGNMENT, G.request_layout(G.Cmd.GET_ALIGNMENT, V).build({"device": 0})))
    assert recv_exact(s, 16)[:8] == G.encode_response(bytes(8))[:8]
    s.close()


def session(sp) -> socket.socket:
    s = socket.create_connection((sp.host, sp.port), timeout=20)
    assert hello(s).version == V
    return s


def call(s: socket.socket, cmd: int, **fields) -> dict:
    s.sendall(G.encode_request(cmd, G.request_layout(cmd, V).build(fields)))
    size = G.RESPONSE_HEADER_STRUCT.unpack(recv_exact(s, 8))[0]
    return G.parse_response_payload(cmd, recv_exact(s, size), V)


def with_buffer(sp, size: int = MiB) -> tuple[socket.socket, int, int]:
    s = session(sp)
    ptr = call(s, G.Cmd.ALLOC_BUFFER, device=0, size=size)["remote_ptr"]
    assert ptr
    return s, ptr, call(s, G.Cmd.BUFFER_GET_BASE, remote_ptr=ptr)["base_ptr"]


def closed_by_us(s: socket.socket) -> None:
    """The refused session ends: EOF (or a reset), never a reply, within the deadline."""
    s.settimeout(20)
    try:
        assert s.recv(65536) == b""
    except ConnectionResetError:
        pass
    s.close()


def f32(ptr: int, data: int, n: int = 4, **kw) -> G.RpcTensor:
    return G.RpcTensor(id=kw.pop("id", 1), type=0, buffer=ptr, ne=(n, 1, 1, 1), nb=(4, 4 * n, 4 * n, 4 * n),
                       data=data, name=b"t".ljust(64, b"\0"), **kw)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def child_of(sp, s: socket.socket) -> int:
    """The pid of the child serving the ggml session on ``s`` (the passthrough logs it)."""
    line = re.compile(rf"ggml-RPC 127\.0\.0\.1:{s.getsockname()[1]} ↔ child (\d+)")
    return int(poll(lambda: line.search(sp.log), "the session's child in the log").group(1))


@pytest.mark.parametrize("size", [2**64 - 1, 2**63], ids=["2^64-1", "2^63"])
def test_set_tensor_with_a_huge_size(server, size):
    """Upstream: std::length_error out of vector::resize → the process aborts."""
    s, ptr, base = with_buffer(server)
    s.sendall(G.encode_request_header(G.Cmd.SET_TENSOR, size) + G.encode_set_tensor(f32(ptr, base), 0, b"", version=V))
    closed_by_us(s)
    assert_alive(server)


def test_set_tensor_below_its_buffer(server):
    """Upstream: GGML_ASSERT(tensor->data >= buffer_start) → abort."""
    s, ptr, base = with_buffer(server)
    body = G.encode_set_tensor(f32(ptr, base - 4096), 0, bytes(16), version=V)
    s.sendall(G.encode_request(G.Cmd.SET_TENSOR, body))
    closed_by_us(s)
    assert_alive(server)


@pytest.mark.parametrize("op", [101, 0xFFFFFFFF, G.enums_for(V).ops.index("CUSTOM")],
                         ids=["GGML_OP_COUNT", "u32-max", "CUSTOM"])
def test_graph_compute_with_a_bad_op(server, op):
    """Upstream: an op past the enum indexes the CPU backend's tables out of bounds; CUSTOM calls a
    function pointer from the wire."""
    s, ptr, base = with_buffer(server)
    a = f32(ptr, base, id=1)
    b = f32(ptr, base + 16, id=2, op=op, src=(1,) + (0,) * 9)
    s.sendall(G.encode_request(G.Cmd.GRAPH_COMPUTE, G.encode_graph_compute([2], [a, b], device=0, version=V)))
    closed_by_us(s)
    assert_alive(server)


def test_graph_compute_with_a_null_node(server):
    """Upstream's own regression input (tools/rpc/test-rpc-invalid-graph-node.py): SIGSEGV."""
    s = session(server)
    s.sendall(G.encode_request(G.Cmd.GRAPH_COMPUTE, G.encode_graph_compute([0], [], device=0, version=V)))
    closed_by_us(s)
    assert_alive(server)


def test_a_gib_claim_does_not_grow_our_memory(server):
    """A 9-byte header claiming 1 GiB holds nothing; a claim that fits a real 256 MiB buffer streams."""
    rss0 = rss_kb(server.proc.pid)
    s, ptr, base = with_buffer(server)
    s.sendall(G.encode_request_header(G.Cmd.SET_TENSOR, GiB))
    s.sendall(G.encode_set_tensor(f32(ptr, base), 0, b"", version=V))  # 1 GiB does not fit 1 MiB
    closed_by_us(s)
    big = 256 * MiB
    s, ptr, base = with_buffer(server, big)
    head = G.encode_set_tensor(f32(ptr, base, n=big // 4), 0, b"", version=V)
    s.sendall(G.encode_request_header(G.Cmd.SET_TENSOR, len(head) + big) + head)
    chunk = bytes(4 * MiB)
    for _ in range(big // len(chunk)):
        s.sendall(chunk)
    assert call(s, G.Cmd.GET_ALIGNMENT, device=0)["alignment"]  # stored: the server answers what came after
    grown = rss_kb(server.proc.pid) - rss0
    assert grown < 64 * 1024, f"our RSS grew {grown} KiB for a 256 MiB upload"
    s.close()
    assert_alive(server)


def test_an_idle_session_blocks_no_one(server):
    """Upstream serves one client at a time; here each session has its own child."""
    idle = [session(server), session(server)]
    s = session(server)
    assert call(s, G.Cmd.GET_ALIGNMENT, device=0)["alignment"]
    for x in (*idle, s):
        x.close()


def test_sessions_beyond_the_limit_are_closed(server):
    held = [session(server) for _ in range(3)]  # --ggml-rpc-sessions 3
    s = socket.create_connection((server.host, server.port), timeout=20)
    s.sendall(G.encode_hello_request())
    closed_by_us(s)  # after --ggml-connect-timeout (5 s): no child free
    for x in held:
        x.close()
    assert_alive(server)


def test_the_child_port_is_closed_once_sealed(server):
    """Nothing but our relay reaches a session's child: its listening socket was shut down before
    the session began, so a direct connection to its port (which would bypass the guard) is refused."""
    s = session(server)
    child = child_of(server, s)
    inodes = {os.readlink(f"/proc/{child}/fd/{fd}") for fd in os.listdir(f"/proc/{child}/fd")}
    states: dict[str, list[int]] = {}
    for line in Path(f"/proc/{child}/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f"socket:[{f[9]}]" in inodes:
            states.setdefault(f[3], []).append(int(f[1].split(":")[1], 16))
    assert "0A" not in states, states  # no LISTEN socket left
    (port,) = states["01"]  # ESTABLISHED: the server's end of our relay's connection
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=10)
    s.close()


def test_a_crashed_child_ends_only_its_session(server):
    s = session(server)
    s2 = session(server)
    os.kill(child_of(server, s2), signal.SIGSEGV)
    closed_by_us(s2)
    assert call(s, G.Cmd.GET_ALIGNMENT, device=0)["alignment"]  # the other session carries on
    s.close()
    poll(lambda: "died: SIGSEGV" in server.log, "the crash in the log")
    assert_alive(server)


def test_a_foreign_connection_to_a_child_is_detected():
    """The sealing handshake counts the connections the child's server accepted."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "hydra_rpc.ggml.child", "--sealed"], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        port = int(proc.stdout.readline().split()[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as intruder:
            hello(intruder)  # served first: it would bypass the guard
        ours = socket.create_connection(("127.0.0.1", port), timeout=10)
        hello(ours)
        proc.stdin.write(b"seal\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"SEALED 2\n"  # the pool discards such a child
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10)
        ours.close()
        assert proc.wait(20) == 0  # the session is over: the child exits on its own
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


def test_a_picked_port_taken_before_the_server_binds_it_is_picked_again():
    """A port found free can be bound by someone else before the server binds it (once a child
    exited silently then, and its session waited for the next one): the next free port is tried."""
    taken = socket.socket()  # bound, not listening, as an outgoing connection's port is
    taken.bind(("127.0.0.1", 0))
    taken_port = taken.getsockname()[1]
    picks = iter([taken_port])
    ended = threading.Event()
    with taken:
        port, listener = start_listening("127.0.0.1", 0, 1, on_end=ended.set,
                                         pick=lambda host: next(picks, 0) or find_free_port(host))
    with listener:
        assert port != taken_port and next(picks, None) is None
        sock, reply = open_session("127.0.0.1", port, 10)
        sock.close()
        assert reply.version[0] == V[0]
        listener.shutdown(socket.SHUT_RDWR)  # as the sealing does: the server's next accept fails
        assert ended.wait(20), "the server that listened did not end"


@pytest.mark.asyncio
async def test_a_child_that_cannot_start_fails_the_pool_loudly():
    pool = GgmlChildPool(threads=1, max_sessions=2, command=[sys.executable, "-c", "raise SystemExit(3)"])
    try:
        with pytest.raises(ChildStartError, match=r"expected READY.*; it ended: exit 3"):
            await pool.start()
        assert pool.stats["failed_starts"] == 1
    finally:
        await pool.close()


@pytest.mark.asyncio
async def test_the_pool_keeps_a_spare_and_kills_released_children():
    pool = GgmlChildPool(threads=1, max_sessions=2)
    await pool.start()
    try:
        child = await pool.acquire(timeout=20)
        assert child is not None and child.hello.version == V
        await until(lambda: pool.spares_ready, "the filler's next spare", timeout=20)
        pool.release(child)
        async with asyncio.timeout(20):
            assert await child.proc.wait() in (0, -signal.SIGKILL)
        assert pool.stats["started"] >= 2 and pool.stats["crashed"] == 0
    finally:
        await pool.close()


@pytest.mark.asyncio
async def test_children_that_keep_failing_are_retried_with_backoff(caplog):
    pool = GgmlChildPool(threads=1, max_sessions=2)
    await pool.start()
    real, pool.command = pool.command, [sys.executable, "-c", "raise SystemExit(3)"]
    try:
        child = await pool.acquire(timeout=20)  # takes the spare: the filler starts failing children
        await until(lambda: pool.stats["failed_starts"] >= 3, "three failed starts", timeout=30)
        delays = [float(m) for m in re.findall(r"next try in ([\d.]+)s", caplog.text)]
        assert delays[:3] == [0.1, 0.2, 0.4]
        pool.command = real  # the cause goes away: the next try succeeds
        await until(lambda: pool.spares_ready, "a spare once the cause is gone", timeout=30)
        pool.release(child)
    finally:
        await pool.close()


def _dead(pid: int) -> bool:
    """The process has exited (a zombie, or already reaped by the loop's child watcher)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.asyncio
async def test_a_child_that_crashed_before_its_release_is_reported(caplog):
    """The session's socket can reach EOF, and release the child, before the loop hears of its
    exit: a crash is a crash even then (a CI run logged nothing for a SIGSEGV that way)."""
    pool = GgmlChildPool(threads=1, max_sessions=2)
    await pool.start()
    try:
        child = await pool.acquire(timeout=20)
        os.kill(child.pid, signal.SIGSEGV)
        wait_until(lambda: _dead(child.pid), "the child's exit")  # no await: the loop has not heard yet
        pool.release(child)
        async with asyncio.timeout(20):
            assert await child.proc.wait() == -signal.SIGSEGV
        await until(lambda: pool.stats["crashed"] == 1, "the crash counted")
        assert f"ggml child {child.pid} died: SIGSEGV" in caplog.text
        released = await pool.acquire(timeout=20)  # and a child we kill ourselves is no crash
        pool.release(released)
        async with asyncio.timeout(20):
            # 0 too: closing its socket ends the session, and the child may exit on its own first
            assert await released.proc.wait() in (0, -signal.SIGKILL)
        await until(lambda: all(t.done() for t in released.tasks), "the watcher's end")
        assert pool.stats["crashed"] == 1
    finally:
        await pool.close()


@pytest.mark.asyncio
async def test_close_reaps_a_child_released_just_before():
    """A session that ends as the server shuts down: close() waits for its dying child too, so
    no process or pipe transport outlives the pool (a loop closed over them fails)."""
    pool = GgmlChildPool(threads=1, max_sessions=2)
    await pool.start()
    child = await pool.acquire(timeout=20)
    pool.release(child)
    await pool.close()
    assert child.proc.returncode is not None
    assert all(t.done() for t in child.tasks)
