"""``rpc_tensor``: the 296-byte packed tensor description every tensor-carrying command uses.

Layout (docs/ggml.md): ``id`` is the client's ``ggml_tensor`` address (0 = null), ``buffer``
the server-side ``remote_ptr`` from ALLOC_BUFFER (0 = not in an RPC buffer), ``data`` an
address in the *server's* address space; ``ne``/``nb`` are truncated to 32 bits on the wire.
The construct ``RPC_TENSOR`` is the declarative source of truth; its ``struct`` twin
``RPC_TENSOR_STRUCT`` serves the hot paths and is proven equal to it by a property test.
"""
from __future__ import annotations

import struct
from typing import Any, NamedTuple

from construct import Array, Bytes, ConstructError, Int32sl, Int32ul, Int64ul, Struct

from ..errors import LocalProtocolError, Truncated

Buffer = bytes | bytearray | memoryview

GGML_MAX_DIMS = 4
GGML_MAX_OP_PARAMS_I32 = 16
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64

RPC_TENSOR = Struct(
    "id" / Int64ul,  # client-side ggml_tensor address, 0 = null
    "type" / Int32ul,
    "buffer" / Int64ul,  # server-side remote_ptr, 0 = not in an RPC buffer
    "ne" / Array(GGML_MAX_DIMS, Int32ul),  # truncated to 32 bits
    "nb" / Array(GGML_MAX_DIMS, Int32ul),
    "op" / Int32ul,
    "op_params" / Array(GGML_MAX_OP_PARAMS_I32, Int32sl),
    "flags" / Int32sl,
    "src" / Array(GGML_MAX_SRC, Int64ul),
    "view_src" / Int64ul,
    "view_offs" / Int64ul,
    "data" / Int64ul,  # address in the server's address space
    "name" / Bytes(GGML_MAX_NAME),  # NUL-padded
    "use_count" / Int32sl,  # padding (zeros) before 5.1.0
)
RPC_TENSOR_STRUCT = struct.Struct("<QIQ4I4II16ii10QQQQ64si")
RPC_TENSOR_SIZE = RPC_TENSOR_STRUCT.size
assert RPC_TENSOR.sizeof() == RPC_TENSOR_SIZE == 296


class RpcTensor(NamedTuple):
    """One decoded rpc_tensor (a NamedTuple: the guard builds several per generated token)."""

    id: int = 0
    type: int = 0
    buffer: int = 0
    ne: tuple[int, ...] = (0, 0, 0, 0)
    nb: tuple[int, ...] = (0, 0, 0, 0)
    op: int = 0
    op_params: tuple[int, ...] = (0,) * GGML_MAX_OP_PARAMS_I32
    flags: int = 0
    src: tuple[int, ...] = (0,) * GGML_MAX_SRC
    view_src: int = 0
    view_offs: int = 0
    data: int = 0
    name: bytes = bytes(GGML_MAX_NAME)  # the raw 64 bytes, so encoding round-trips exactly
    use_count: int = 0

    @property
    def name_str(self) -> str:
        return self.name.split(b"\0", 1)[0].decode("utf-8", "replace")


def tensor_from_flat(v: tuple[Any, ...]) -> RpcTensor:
    # field order of RPC_TENSOR_STRUCT: id type buffer ne×4 nb×4 op op_params×16 flags src×10 …
    return RpcTensor(v[0], v[1], v[2], v[3:7], v[7:11], v[11], v[12:28], v[28], v[29:39], v[39], v[40], v[41],
                     v[42], v[43])


def tensor_from_container(c: Any) -> RpcTensor:
    return RpcTensor(c.id, c.type, c.buffer, tuple(c.ne), tuple(c.nb), c.op, tuple(c.op_params), c.flags,
                     tuple(c.src), c.view_src, c.view_offs, c.data, c.name, c.use_count)


def parse_rpc_tensor(buf: Buffer, offset: int = 0) -> RpcTensor:
    if len(buf) - offset < RPC_TENSOR_SIZE or offset < 0:
        raise Truncated(f"rpc_tensor needs {RPC_TENSOR_SIZE} bytes", rule="ggml.tensor_short")
    return tensor_from_flat(RPC_TENSOR_STRUCT.unpack_from(buf, offset))


def parse_rpc_tensor_construct(buf: Buffer, offset: int = 0) -> RpcTensor:
    try:
        c = RPC_TENSOR.parse(bytes(buf[offset:]) if offset >= 0 else b"")
    except ConstructError as e:
        raise Truncated(f"rpc_tensor: {e}", rule="ggml.tensor_short") from None
    return tensor_from_container(c)


def encode_rpc_tensor(t: RpcTensor) -> bytes:
    name = t.name.encode() if isinstance(t.name, str) else t.name
    try:
        return RPC_TENSOR_STRUCT.pack(t.id, t.type, t.buffer, *t.ne, *t.nb, t.op, *t.op_params, t.flags, *t.src,
                                      t.view_src, t.view_offs, t.data, name.ljust(GGML_MAX_NAME, b"\0"),
                                      t.use_count)
    except struct.error as e:
        raise LocalProtocolError(f"rpc_tensor field out of range: {e}", rule="ggml.tensor") from None
