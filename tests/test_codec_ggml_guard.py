"""The ggml-RPC session guard (codec/ggml/guard.py), its struct twins and ggml's enum tables.

Every refusal below is an input that crashed llama.cpp's rpc-server (issue 13 item 3, the
advisories listed in docs/ggml.md) or reaches outside the session's own buffers. Spawned-server
regressions for the same inputs are in tests/test_ggml_embedded.py.
"""
from __future__ import annotations

import ctypes
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codec import ggml as G
from codec.ggml.fast import fast_layout
from codec.ggml.guard import MAX_GRAPH_DEPTH, Refused, SessionGuard

V = (7, 0, 0)
PTR, BASE, SIZE = 0x5000, 0x7F0000001000, 1 << 20
GIB = 1 << 30


def req(cmd: int, **fields) -> bytes:
    fields = {k: v._asdict() if isinstance(v, G.RpcTensor) else v for k, v in fields.items()}
    return G.encode_request(cmd, G.request_layout(cmd, V).build(fields))


def rsp(cmd: int, **fields) -> bytes:
    return G.encode_response(G.response_layout(cmd, V).build(fields))


def f32(id_: int, n: int = 4, *, data: int = BASE, buffer: int = PTR, op: int = 0, src=(), view_src: int = 0,
        name: bytes = b"t") -> G.RpcTensor:
    return G.RpcTensor(id=id_, type=0, buffer=buffer, ne=(n, 1, 1, 1), nb=(4, 4 * n, 4 * n, 4 * n), op=op,
                       src=tuple(src) + (0,) * (10 - len(src)), view_src=view_src, data=data, name=name.ljust(64, b"\0"))


def set_tensor(t: G.RpcTensor, data: bytes, offset: int = 0, size: int | None = None) -> bytes:
    body = G.encode_set_tensor(t, offset, data, version=V)
    return G.encode_request_header(G.Cmd.SET_TENSOR, len(body) if size is None else size) + body


def graph(tensors, nodes) -> bytes:
    return G.encode_request(G.Cmd.GRAPH_COMPUTE, G.encode_graph_compute(nodes, tensors, device=0, version=V))


def joined(chunks) -> bytes:
    return b"".join(bytes(c) for c in chunks)


@pytest.fixture
def guard() -> SessionGuard:
    """A session past HELLO with one 1 MiB buffer whose base is known."""
    g = SessionGuard(V, max_alloc_bytes=4 * GIB)
    assert g.requests.feed(G.encode_hello_request()) == []  # answered locally, never forwarded
    assert g.requests.to_client == [G.encode_hello_response(V)]
    for direction, data in session_steps()[1:5]:
        assert joined(getattr(g, direction).feed(data)) == data
    assert g.buffers[PTR].base == BASE and g.allocated == SIZE
    return g


def session_steps() -> list[tuple[str, bytes]]:
    """A well-behaved session, as (direction, bytes): the client waits for each reply it needs."""
    a, b = f32(1, data=BASE), f32(2, data=BASE + 16)
    c = f32(3, data=BASE + 32, op=2, src=(1, 2))  # ADD
    return [
        ("requests", G.encode_hello_request()),
        ("requests", req(G.Cmd.ALLOC_BUFFER, device=0, size=SIZE)),
        ("responses", rsp(G.Cmd.ALLOC_BUFFER, remote_ptr=PTR, remote_size=SIZE)),
        ("requests", req(G.Cmd.BUFFER_GET_BASE, remote_ptr=PTR)),
        ("responses", rsp(G.Cmd.BUFFER_GET_BASE, base_ptr=BASE)),
        ("requests", set_tensor(a, bytes(range(16))) + set_tensor(b, b"\1" * 16) + graph([a, b, c], [3])
         + req(G.Cmd.GRAPH_RECOMPUTE, device=0) + req(G.Cmd.GET_TENSOR, tensor=c, offset=0, size=16)
         + set_tensor(f32(4, n=250, data=BASE + 64), bytes(1000))),
        ("responses", G.encode_response(bytes(16))),
    ]


def test_a_session_passes_unchanged_except_its_hello():
    g = SessionGuard(V, max_alloc_bytes=GIB)
    for i, (direction, data) in enumerate(session_steps()):
        assert joined(getattr(g, direction).feed(data)) == (b"" if i == 0 else data)
    assert not g.pending and g.requests.to_client == [G.encode_hello_response(V)]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_chunking_never_changes_what_is_forwarded(data):
    g = SessionGuard(V, max_alloc_bytes=GIB)
    for i, (direction, stream) in enumerate(session_steps()):
        cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
        parts = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
        forwarded = b"".join(joined(getattr(g, direction).feed(p)) for p in parts)
        assert forwarded == (b"" if i == 0 else stream)


def test_bodies_stream_without_being_held(guard):
    """A SET_TENSOR's data passes as slices of the input; ``consume_body`` lets a relay move it."""
    t = f32(1, n=SIZE // 4)
    frame = set_tensor(t, bytes(SIZE))
    head = frame[: 9 + G.set_tensor_header_size(V)]
    assert joined(guard.requests.feed(head)) == head and guard.requests.body_left == SIZE
    out = guard.requests.feed(memoryview(frame)[len(head) : len(head) + 4096])
    assert len(out) == 1 and isinstance(out[0], memoryview) and len(out[0]) == 4096
    guard.requests.consume_body(SIZE - 4096)  # e.g. spliced by the relay
    assert guard.requests.body_left == 0
    assert joined(guard.requests.feed(req(G.Cmd.GRAPH_RECOMPUTE, device=0)))


def test_a_9_byte_header_claiming_a_gib_holds_only_the_head(guard):
    out = guard.requests.feed(G.encode_request_header(G.Cmd.SET_TENSOR, GIB))
    assert out == [] and len(guard.requests._held) == 9  # nothing forwarded, nothing allocated for the claim
    with pytest.raises(Refused) as e:  # the head arrives: 1 GiB does not fit the 1 MiB buffer
        guard.requests.feed(G.encode_set_tensor(f32(1), 0, b"", version=V))
    assert e.value.rule == "ggml.guard.region"


@pytest.mark.parametrize("size", [2**64 - 1, 2**63, 305 + SIZE + 1])
def test_set_tensor_sizes_beyond_the_buffer(guard, size):
    with pytest.raises(Refused, match="outside buffer"):
        guard.requests.feed(set_tensor(f32(1), b"", size=size))


@pytest.mark.parametrize("tensor, rule", [
    (f32(1, data=BASE - 16), "ggml.guard.bounds"),  # data below its buffer: GGML_ASSERT
    (f32(1, data=BASE + SIZE - 8), "ggml.guard.bounds"),  # runs past the end
    (f32(1, buffer=0x6000), "ggml.guard.buffer"),  # someone else's buffer
    (f32(1, buffer=0), "ggml.guard.buffer"),
    (G.RpcTensor(id=1, type=4, buffer=PTR, ne=(32, 1, 1, 1), data=BASE), "ggml.guard.type"),  # block size 0
    (G.RpcTensor(id=1, type=99, buffer=PTR, data=BASE), "ggml.guard.type"),
    (G.RpcTensor(id=1, buffer=PTR, ne=(2**32 - 1,) * 3 + (1,), data=BASE), "ggml.guard.ne"),  # int64 overflow
])
def test_bad_tensors_are_refused(guard, tensor, rule):
    with pytest.raises(Refused) as e:
        guard.requests.feed(set_tensor(tensor, b"x"))
    assert e.value.rule == rule


def test_buffers_follow_the_session(guard):
    with pytest.raises(Refused, match="not one of this session's buffers"):
        guard.requests.feed(req(G.Cmd.BUFFER_CLEAR, remote_ptr=0x4141, value=0))
    g = SessionGuard(V, max_alloc_bytes=GIB)
    g.requests.feed(G.encode_hello_request() + req(G.Cmd.ALLOC_BUFFER, device=0, size=64))
    g.responses.feed(rsp(G.Cmd.ALLOC_BUFFER, remote_ptr=PTR, remote_size=64))
    with pytest.raises(Refused, match="before BUFFER_GET_BASE"):
        g.requests.feed(set_tensor(f32(1), b"x"))
    guard.requests.feed(req(G.Cmd.FREE_BUFFER, remote_ptr=PTR))
    assert guard.allocated == 0
    with pytest.raises(Refused, match="not one of this session's buffers"):
        guard.requests.feed(set_tensor(f32(1), b"x"))


def test_allocation_budget_counts_unanswered_requests():
    g = SessionGuard(V, max_alloc_bytes=GIB)
    g.requests.feed(G.encode_hello_request() + req(G.Cmd.ALLOC_BUFFER, device=0, size=GIB // 2))
    with pytest.raises(Refused) as e:
        g.requests.feed(req(G.Cmd.ALLOC_BUFFER, device=0, size=GIB // 2 + 1))
    assert e.value.rule == "ggml.guard.alloc"


@pytest.mark.parametrize("build, rule", [
    (lambda: graph([f32(1)], [0]), "ggml.guard.graph_node"),  # null node: SIGSEGV upstream
    (lambda: graph([f32(1)], [2]), "ggml.guard.graph_node"),
    (lambda: graph([f32(1)], [1, 1]), "ggml.guard.graph_node"),
    (lambda: graph([f32(1, op=101)], [1]), "ggml.guard.op"),  # past GGML_OP_COUNT
    (lambda: graph([f32(1, op=0xFFFFFFFF)], [1]), "ggml.guard.op"),
    (lambda: graph([f32(1, op=G.enums_for(V).ops.index("MAP_CUSTOM1"))], [1]), "ggml.guard.custom_op"),
    (lambda: graph([f32(1, src=(2,)), f32(2)], [1]), "ggml.guard.graph_src"),  # source after its consumer
    (lambda: graph([f32(1), f32(1)], [1]), "ggml.guard.graph_id"),
    (lambda: graph([f32(0)], []), "ggml.guard.graph_id"),
    (lambda: graph([f32(1, buffer=0, data=0)], [1]), "ggml.guard.buffer"),  # computed at address 0
    (lambda: G.encode_request(G.Cmd.GRAPH_COMPUTE, struct.pack("<IIQI", 0, 1, 0, 0)), "ggml.guard.graph_node"),
    (lambda: G.encode_request(G.Cmd.GRAPH_COMPUTE, struct.pack("<II", 0, 2**32 - 1)), "ggml.graph_nodes"),
    (lambda: G.encode_request_header(G.Cmd.GRAPH_COMPUTE, 1 << 40), "ggml.guard.graph_size"),
])
def test_bad_graphs_are_refused(guard, build, rule):
    with pytest.raises(Refused) as e:
        guard.requests.feed(build())
    assert e.value.rule == rule


def test_deep_graphs_are_refused(guard):
    chain = [f32(1)] + [f32(i, src=(i - 1,)) for i in range(2, MAX_GRAPH_DEPTH + 2)]
    assert joined(guard.requests.feed(graph(chain[:-1], [MAX_GRAPH_DEPTH])))  # as deep as allowed
    with pytest.raises(Refused) as e:
        guard.requests.feed(graph(chain, [MAX_GRAPH_DEPTH + 1]))
    assert e.value.rule == "ggml.guard.graph_depth"


@pytest.mark.parametrize("stream, rule", [
    (req(G.Cmd.GET_ALIGNMENT, device=0), "ggml.guard.hello"),  # HELLO first
    (G.encode_hello_request(legacy=True), "ggml.guard.hello"),  # 7.x wants 24 bytes of caps
    (G.encode_hello_request() * 2, "ggml.guard.cmd"),  # a second HELLO
    (G.encode_hello_request() + G.encode_request(G.Cmd.NONE), "ggml.guard.cmd"),
    (G.encode_hello_request() + G.encode_request(0x14), "ggml.guard.cmd"),
    (G.encode_hello_request() + G.encode_request_header(G.Cmd.GET_ALIGNMENT, GIB), "ggml.guard.size"),
])
def test_framing_refusals(stream, rule):
    g = SessionGuard(V, max_alloc_bytes=GIB)
    with pytest.raises(Refused) as e:
        g.requests.feed(stream)
    assert e.value.rule == rule


def test_replies_are_held_to_what_the_client_checks(guard):
    with pytest.raises(Refused, match="no request was waiting"):
        guard.responses.feed(G.encode_response(b"x"))
    guard.requests.feed(req(G.Cmd.GET_TENSOR, tensor=f32(1), offset=0, size=16))
    with pytest.raises(Refused, match="reply is 15 bytes, not 16"):
        guard.responses.feed(G.encode_response(bytes(15)))


def test_reads_and_writes_stay_inside_their_tensor(guard):
    """Inside the buffer but past the tensor: ggml_backend_tensor_set/get GGML_ASSERT (found by
    ``hydra-rpc fuzz --protocol ggml``: a contained child crash)."""
    with pytest.raises(Refused, match="past the end of tensor"):
        guard.requests.feed(set_tensor(f32(1, n=4), bytes(17)))
    with pytest.raises(Refused, match="past the end of tensor"):
        guard.requests.feed(req(G.Cmd.GET_TENSOR, tensor=f32(1, n=4), offset=8, size=9))


def test_get_and_copy_stay_inside_the_buffer(guard):
    with pytest.raises(Refused, match="outside buffer"):
        guard.requests.feed(req(G.Cmd.GET_TENSOR, tensor=f32(1), offset=SIZE, size=1))
    big = f32(2, n=SIZE // 4)
    with pytest.raises(Refused, match="COPY_TENSOR"):
        guard.requests.feed(req(G.Cmd.COPY_TENSOR, src=big, dst=f32(3, n=16, data=BASE + 64)))  # heap overflow upstream


# ---- struct twins and tables ---------------------------------------------------------------

VERSIONS = [None, (3, 0, 0), (3, 6, 1), (4, 0, 0), (7, 0, 0), (7, 0, 1)]
FIXED = [(cmd, v, way) for v in VERSIONS for cmd in G.Cmd for way in ("request", "response")
         if getattr(G, f"{way}_layout")(cmd, v) is not None]


@pytest.mark.parametrize("cmd, version, way", FIXED, ids=str)
@settings(max_examples=15, deadline=None)
@given(rnd=st.randoms(use_true_random=False))
def test_fast_layouts_parse_like_construct(cmd, version, way, rnd):
    layout = getattr(G, f"{way}_layout")(cmd, version)
    raw = rnd.randbytes(layout.sizeof())
    fast = fast_layout(layout).unpack(raw)
    slow = getattr(G, f"parse_{way}_payload")(cmd, raw, version)

    def plain(v):
        if isinstance(v, G.RpcTensor):
            return G.parse_request_payload(G.Cmd.INIT_TENSOR, G.encode_rpc_tensor(v), (7, 0, 0))["tensor"]
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v

    assert {k: plain(v) for k, v in fast.items()} == slow


def test_enum_tables_match_the_installed_libggml():
    from engine.ggml_rpc_lib import client_proto_version, libggml

    g = libggml()
    for fn, res in (("ggml_op_name", ctypes.c_char_p), ("ggml_type_name", ctypes.c_char_p),
                    ("ggml_blck_size", ctypes.c_int64), ("ggml_type_size", ctypes.c_size_t)):
        getattr(g, fn).restype, getattr(g, fn).argtypes = res, [ctypes.c_int]
    enums = G.enums_for(client_proto_version())
    assert enums is not None, "the codec does not know the ops of the installed llama.cpp"
    assert list(enums.ops) == [g.ggml_op_name(i).decode() for i in range(len(enums.ops))]
    for i, traits in enumerate(enums.types):
        got = (g.ggml_type_name(i).decode(), g.ggml_blck_size(i), g.ggml_type_size(i))
        assert (traits.name, traits.block_size, traits.type_size) == got if traits else got[1] == 0, i
