"""The ggml-RPC cases: malformed framing and handshakes, then what has crashed llama.cpp's rpc-server.

Every byte comes from the codec (``codec.ggml`` layouts and encoders). Cases that need a real
buffer on the server (generator ``ggml.buffer.*``) are sent after a prelude the runner performs
on the same connection — HELLO, ALLOC_BUFFER of :data:`BUFFER_SIZE`, BUFFER_GET_BASE — and refer
to that buffer through markers the runner replaces with the real values (:func:`resolve`), so a
case stays pure data and a saved finding replays against a fresh server.
"""
from __future__ import annotations

import random
import struct

from codec import ggml as G

V = (7, 0, 0)  # the layouts the cases are written in: the protocol of the embedded server
BUFFER_SIZE = 1 << 20
PTR_MARK = 0x7F7F_0000_0000_0001  # → the prelude's remote_ptr
BASE_ZERO = 0x7E7E_0000_8000_0000  # BASE_ZERO + d → the buffer's base + d, for |d| < 2^31
_PTR = struct.pack("<Q", PTR_MARK)
_BASE_TAG = b"\x00\x00\x7e\x7e"  # bytes 4..7 of every BASE_ZERO + d
HELLO = G.encode_hello_request()
TENSOR_FIELDS = {name: (offset, size) for name, offset, size in G.layout_fields(G.RPC_TENSOR)}
INTERESTING = (0, 1, 2, 3, 4, 5, 31, 32, 33, 42, 43, 95, 96, 97, 100, 101, 255, 0x7FFFFFFF, 0xFFFFFFFF)


def base(delta: int = 0) -> int:
    return BASE_ZERO + delta


def resolve(data: bytes, ptr: int, buffer_base: int) -> bytes:
    """Replace the buffer markers by the prelude's real remote_ptr and base."""
    data = data.replace(_PTR, struct.pack("<Q", ptr))
    out, i = bytearray(data), data.find(_BASE_TAG)
    while i != -1:
        if i >= 4:
            v = struct.unpack_from("<Q", out, i - 4)[0]
            struct.pack_into("<Q", out, i - 4, (buffer_base + v - BASE_ZERO) % (1 << 64))
        i = data.find(_BASE_TAG, i + 1)
    return bytes(out)


def _req(cmd: int, **fields) -> bytes:
    fields = {k: v._asdict() if isinstance(v, G.RpcTensor) else v for k, v in fields.items()}
    return G.encode_request(cmd, G.request_layout(cmd, V).build(fields))


def _tensor(id_: int = 1, *, n: int = 4, delta: int = 0, **kw) -> G.RpcTensor:
    """An f32 vector of ``n`` elements at base + delta in the prelude's buffer."""
    kw.setdefault("buffer", PTR_MARK)
    src = tuple(kw.pop("src", ()))
    return G.RpcTensor(id=id_, type=kw.pop("type", 0), ne=(n, 1, 1, 1), nb=(4, 4 * n, 4 * n, 4 * n),
                       data=kw.pop("data", base(delta)), src=src + (0,) * (G.GGML_MAX_SRC - len(src)),
                       name=b"fuzz".ljust(G.GGML_MAX_NAME, b"\0"), **kw)


def _set(t: G.RpcTensor, data: bytes = b"\0" * 16, size: int | None = None) -> bytes:
    body = G.encode_set_tensor(t, 0, data, version=V)
    return G.encode_request_header(G.Cmd.SET_TENSOR, len(body) if size is None else size) + body


def _graph(tensors: list[G.RpcTensor], nodes: list[int]) -> bytes:
    return G.encode_request(G.Cmd.GRAPH_COMPUTE, G.encode_graph_compute(nodes, tensors, device=0, version=V))


def _framing() -> list[tuple[str, str, bytes]]:
    """(generator, note, bytes) of the handshake and framing cases: no buffer needed."""
    dev0 = G.request_layout(G.Cmd.GET_ALIGNMENT, V).build({"device": 0})
    out = [
        ("hello", "valid HELLO", HELLO),
        ("hello", "legacy (size 0) HELLO", G.encode_request(G.Cmd.HELLO)),
        ("hello", "HELLO size 23", G.encode_request(G.Cmd.HELLO, bytes(23))),
        ("hello", "HELLO size 25", G.encode_request(G.Cmd.HELLO, bytes(25))),
        ("hello", "HELLO caps all 0xff", G.encode_request(G.Cmd.HELLO, b"\xff" * 24)),
        ("hello", "HELLO twice", HELLO + HELLO),
    ]
    out += [("hello.truncated", f"HELLO cut after {n} bytes", HELLO[:n]) for n in (1, 5, 9, 20, 32)]
    out += [("first_cmd", f"cmd {c} before HELLO", G.encode_request(c, dev0)) for c in range(0x14) if c != G.Cmd.HELLO]
    after = [
        ("GET_ALIGNMENT", _req(G.Cmd.GET_ALIGNMENT, device=0)),
        ("GET_ALIGNMENT no device", G.encode_request(G.Cmd.GET_ALIGNMENT)),
        ("GET_ALIGNMENT 5 bytes", G.encode_request(G.Cmd.GET_ALIGNMENT, bytes(5))),
        ("DEVICE_COUNT", G.encode_request(G.Cmd.DEVICE_COUNT)),
        ("DEVICE_COUNT with payload", G.encode_request(G.Cmd.DEVICE_COUNT, b"x")),
        ("GET_DEVICE_MEMORY device 99", _req(G.Cmd.GET_DEVICE_MEMORY, device=99)),
        ("GET_MAX_SIZE device 0xffffffff", _req(G.Cmd.GET_MAX_SIZE, device=0xFFFFFFFF)),
        ("unknown cmd 0x14", G.encode_request(0x14)), ("unknown cmd 0xff", G.encode_request(0xFF, b"abc")),
        ("cmd NONE (18)", G.encode_request(G.Cmd.NONE)),
        ("FREE_BUFFER of a made-up pointer", _req(G.Cmd.FREE_BUFFER, remote_ptr=0x4141414141)),
        ("BUFFER_GET_BASE of 0", _req(G.Cmd.BUFFER_GET_BASE, remote_ptr=0)),
        ("frame cut inside the size", _req(G.Cmd.GET_ALIGNMENT, device=0)[:5]),
        ("frame cut inside the payload", _req(G.Cmd.GET_ALIGNMENT, device=0)[:11]),
        ("ALLOC_BUFFER 0 bytes", _req(G.Cmd.ALLOC_BUFFER, device=0, size=0)),
        ("ALLOC_BUFFER 2^63 bytes", _req(G.Cmd.ALLOC_BUFFER, device=0, size=1 << 63)),
        ("GRAPH_COMPUTE null node (upstream regression test)", _graph([], [0])),
        ("SET_TENSOR buffer 0 with data", _set(_tensor(buffer=0, data=0x1234))),
        ("INIT_TENSOR made-up buffer", _req(G.Cmd.INIT_TENSOR, tensor=_tensor(buffer=0x4141))),
        ("SET_TENSOR size 2**40 declared", G.encode_request_header(G.Cmd.SET_TENSOR, 1 << 40)),
    ]
    return out + [("after_hello", f"HELLO, then {note}", HELLO + data) for note, data in after]


def _buffer_cases() -> list[tuple[str, str, bytes]]:
    """What crashed llama.cpp's rpc-server (issue 13 item 3, the advisories in docs/ggml.md), each
    against a real 1 MiB buffer of the session."""
    ops = G.enums_for(V).ops
    a, b = _tensor(1), _tensor(2, delta=16)
    add = ops.index("ADD")
    cases = [
        ("valid SET_TENSOR, GRAPH_COMPUTE (ADD), GET_TENSOR",
         _set(a) + _set(b) + _graph([a, b, _tensor(3, delta=32, op=add, src=(1, 2))], [3])
         + _req(G.Cmd.GET_TENSOR, tensor=_tensor(3, delta=32), offset=0, size=16)),
        ("SET_TENSOR size 2^64-1 (std::length_error)", _set(a, b"", size=2**64 - 1)),
        ("SET_TENSOR size 2^63", _set(a, b"", size=2**63)),
        ("SET_TENSOR 9-byte header claiming 1 GiB", G.encode_request_header(G.Cmd.SET_TENSOR, 1 << 30)),
        ("SET_TENSOR data below its buffer (GGML_ASSERT)", _set(_tensor(delta=-4096))),
        ("SET_TENSOR data past its buffer", _set(_tensor(delta=BUFFER_SIZE - 8))),
        ("SET_TENSOR type 4 (block size 0: SIGFPE)", _set(_tensor(type=4, n=32))),
        ("SET_TENSOR type 99", _set(_tensor(type=99))),
        ("SET_TENSOR ne overflowing int64", _set(a._replace(ne=(2**32 - 1,) * 3 + (1,)))),
        ("GET_TENSOR past the buffer", _req(G.Cmd.GET_TENSOR, tensor=a, offset=BUFFER_SIZE, size=16)),
        ("COPY_TENSOR larger than dst (heap overflow)",
         _req(G.Cmd.COPY_TENSOR, src=_tensor(1, n=BUFFER_SIZE // 4), dst=_tensor(2, delta=64))),
        ("FREE_BUFFER then SET_TENSOR into it", _req(G.Cmd.FREE_BUFFER, remote_ptr=PTR_MARK) + _set(a)),
        ("FREE_BUFFER then GRAPH_RECOMPUTE", _req(G.Cmd.FREE_BUFFER, remote_ptr=PTR_MARK)
         + _req(G.Cmd.GRAPH_RECOMPUTE, device=0)),
        ("GRAPH_COMPUTE op GGML_OP_COUNT", _graph([a, _tensor(2, delta=16, op=len(ops), src=(1,))], [2])),
        ("GRAPH_COMPUTE op 0xffffffff", _graph([a, _tensor(2, delta=16, op=0xFFFFFFFF, src=(1,))], [2])),
        ("GRAPH_COMPUTE op CUSTOM (a function pointer from the wire)",
         _graph([a, _tensor(2, delta=16, op=ops.index("CUSTOM"), src=(1,))], [2])),
        ("GRAPH_COMPUTE node naming no tensor", _graph([a], [7])),
        ("GRAPH_COMPUTE source after its consumer", _graph([_tensor(2, src=(1,)), a], [2])),
        ("GRAPH_COMPUTE tensor without a buffer", _graph([_tensor(buffer=0, data=0)], [1])),
        ("GRAPH_COMPUTE 20,000-deep chain (stack overflow in create_node)",
         _graph([a] + [_tensor(i, op=add, src=(i - 1, i - 1)) for i in range(2, 20_002)], [20_001])),
    ]
    return [("buffer", note, data) for note, data in cases]


SWEEP = _framing() + _buffer_cases()


def mutate(rng: random.Random, data: bytes, needs_buffer: bool) -> tuple[bytes, str]:
    """One mutation of a sweep case: a field of its first tensor set to an interesting value, a
    bit flip after the first header, or junk appended."""
    data = bytearray(data)
    first_tensor = 9 if needs_buffer and data[:1] in (bytes((G.Cmd.SET_TENSOR,)), bytes((G.Cmd.GET_TENSOR,))) \
        else None
    roll = rng.random()
    if first_tensor is not None and len(data) >= first_tensor + G.RPC_TENSOR_SIZE and roll < 0.5:
        name = rng.choice(("type", "op", "ne", "nb", "data", "buffer", "view_src", "src"))
        offset, size = TENSOR_FIELDS[name]
        width = 4 if size % 8 else 8
        at = first_tensor + offset + width * rng.randrange(size // width)
        value = rng.choice(INTERESTING) if width == 4 else rng.choice(
            (0, PTR_MARK, base(-1), base(BUFFER_SIZE), base(1 << 30), 2**63, 2**64 - 1))
        struct.pack_into("<I" if width == 4 else "<Q", data, at, value % (1 << (8 * width)))
        return bytes(data), f"tensor.{name} @{at} = {value:#x}"
    if len(data) > 10 and roll < 0.85:
        pos = rng.randrange(9, len(data))
        data[pos] ^= 1 << rng.randrange(8)
        return bytes(data), f"bit flip @{pos}"
    data += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 20)))
    return bytes(data), "junk appended"
