"""Payloads: GRAPH_COMPUTE, the SET_TENSOR head, and any fixed-layout request or response.

GRAPH_COMPUTE (3.0+)::

    device u32 | n_nodes u32 | n_nodes × node id u64 | n_tensors u32 | n_tensors × rpc_tensor

(no ``device`` before 3.0). SET_TENSOR is ``rpc_tensor | cache_flag u8 (7.x) | offset u64 |
data``, where the data can be gigabytes: only its fixed head is ever parsed.
"""
from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from construct import (
    Array,
    Construct,
    ConstructError,
    Container,
    Int8ul,
    Int32ul,
    Int64ul,
    ListContainer,
    Struct,
    Terminated,
    this,
)

from ..errors import LocalProtocolError, MalformedPayload, Truncated
from .commands import Cmd, at_least, command_name, normalize_version, request_layout, response_layout
from .tensor import (
    RPC_TENSOR,
    RPC_TENSOR_SIZE,
    RPC_TENSOR_STRUCT,
    Buffer,
    RpcTensor,
    encode_rpc_tensor,
    parse_rpc_tensor,
    tensor_from_container,
    tensor_from_flat,
)

GRAPH_COMPUTE = Struct(
    "device" / Int32ul, "n_nodes" / Int32ul, "nodes" / Array(this.n_nodes, Int64ul),
    "n_tensors" / Int32ul, "tensors" / Array(this.n_tensors, RPC_TENSOR), Terminated,
)
GRAPH_COMPUTE_PRE3 = Struct(
    "n_nodes" / Int32ul, "nodes" / Array(this.n_nodes, Int64ul),
    "n_tensors" / Int32ul, "tensors" / Array(this.n_tensors, RPC_TENSOR), Terminated,
)
_U32 = struct.Struct("<I")
_BIG_ENDIAN = sys.byteorder == "big"


@dataclass(frozen=True, slots=True)
class GraphCompute:
    device: int | None  # None before 3.0.0
    nodes: tuple[int, ...]
    tensors: tuple[RpcTensor, ...]


def parse_graph_compute(payload: Buffer, version: Iterable[int] | None = None, *,
                        allow_trailing: bool = False) -> GraphCompute:
    """Counts are checked against the bytes left before anything is allocated. Upstream only
    checks ``size <`` needed; trailing bytes are refused here unless ``allow_trailing``."""
    has_device = at_least(normalize_version(version), 3)
    n, off = len(payload), 0
    device = None
    if has_device:
        if n < 4:
            raise Truncated("GRAPH_COMPUTE shorter than device", rule="ggml.graph_short")
        device = _U32.unpack_from(payload, 0)[0]
        off = 4
    if n - off < 4:
        raise Truncated("GRAPH_COMPUTE shorter than n_nodes", rule="ggml.graph_short")
    n_nodes = _U32.unpack_from(payload, off)[0]
    off += 4
    if n_nodes * 8 > n - off:
        raise Truncated(f"{n_nodes} node ids do not fit", rule="ggml.graph_nodes")
    nodes = array("Q")
    nodes.frombytes(payload[off : off + 8 * n_nodes])
    if _BIG_ENDIAN:  # pragma: no cover
        nodes.byteswap()
    off += 8 * n_nodes
    if n - off < 4:
        raise Truncated("GRAPH_COMPUTE shorter than n_tensors", rule="ggml.graph_short")
    n_tensors = _U32.unpack_from(payload, off)[0]
    off += 4
    need = n_tensors * RPC_TENSOR_SIZE
    if need > n - off:
        raise Truncated(f"{n_tensors} tensors do not fit", rule="ggml.graph_tensors")
    if need < n - off and not allow_trailing:
        raise MalformedPayload(f"{n - off - need} trailing bytes", rule="ggml.graph_trailing")
    tensors = tuple(tensor_from_flat(t) for t in RPC_TENSOR_STRUCT.iter_unpack(payload[off : off + need]))
    return GraphCompute(device, tuple(nodes), tensors)


def parse_graph_compute_construct(payload: Buffer, version: Iterable[int] | None = None) -> GraphCompute:
    has_device = at_least(normalize_version(version), 3)
    try:
        c = (GRAPH_COMPUTE if has_device else GRAPH_COMPUTE_PRE3).parse(bytes(payload))
    except ConstructError as e:
        raise MalformedPayload(f"GRAPH_COMPUTE: {e}", rule="ggml.graph_construct") from None
    tensors = tuple(tensor_from_container(t) for t in c.tensors)
    return GraphCompute(c.device if has_device else None, tuple(c.nodes), tensors)


def encode_graph_compute(nodes: Iterable[int], tensors: Iterable[RpcTensor], *, device: int | None = 0,
                         version: Iterable[int] | None = (3, 6, 1)) -> bytes:
    nodes, tensors = list(nodes), list(tensors)
    head = _U32.pack(device or 0) if at_least(normalize_version(version), 3) else b""
    try:
        node_bytes = struct.pack(f"<{len(nodes)}Q", *nodes)
    except struct.error as e:
        raise LocalProtocolError(f"node id out of range: {e}", rule="ggml.graph") from None
    return b"".join((head, _U32.pack(len(nodes)), node_bytes, _U32.pack(len(tensors)),
                     *map(encode_rpc_tensor, tensors)))


SET_TENSOR_HEAD = Struct("tensor" / RPC_TENSOR, "offset" / Int64ul)
SET_TENSOR_HEAD_V7 = Struct("tensor" / RPC_TENSOR, "cache_flag" / Int8ul, "offset" / Int64ul)
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class SetTensorHeader:
    tensor: RpcTensor
    cache_flag: int | None  # 7.x only
    offset: int
    data_offset: int  # where the data starts in the payload
    data_len: int


def set_tensor_header_size(version: Iterable[int] | None = None) -> int:
    return RPC_TENSOR_SIZE + (1 if at_least(normalize_version(version), 7) else 0) + 8


def parse_set_tensor_header(prefix: Buffer, payload_size: int | None = None,
                            version: Iterable[int] | None = None) -> SetTensorHeader:
    """Parse the fixed head of a (possibly huge) SET_TENSOR payload from its first bytes."""
    hsize = set_tensor_header_size(version)
    total = len(prefix) if payload_size is None else payload_size
    if total < hsize:
        raise MalformedPayload(f"SET_TENSOR payload of {total} bytes < {hsize}", rule="ggml.set_tensor_short")
    if len(prefix) < hsize:
        raise Truncated(f"need the first {hsize} bytes", rule="ggml.set_tensor_prefix")
    tensor = parse_rpc_tensor(prefix)
    cache_flag = prefix[RPC_TENSOR_SIZE] if hsize == RPC_TENSOR_SIZE + 9 else None
    offset = _U64.unpack_from(prefix, hsize - 8)[0]
    return SetTensorHeader(tensor, cache_flag, offset, hsize, total - hsize)


def parse_set_tensor_header_construct(prefix: Buffer, payload_size: int | None = None,
                                      version: Iterable[int] | None = None) -> SetTensorHeader:
    """:func:`parse_set_tensor_header` through the construct layouts (differential twin)."""
    v7 = at_least(normalize_version(version), 7)
    hsize = set_tensor_header_size(version)
    total = len(prefix) if payload_size is None else payload_size
    if total < hsize:
        raise MalformedPayload(f"SET_TENSOR payload of {total} bytes < {hsize}", rule="ggml.set_tensor_short")
    try:
        c = (SET_TENSOR_HEAD_V7 if v7 else SET_TENSOR_HEAD).parse(bytes(prefix))
    except ConstructError as e:
        raise Truncated(f"SET_TENSOR head: {e}", rule="ggml.set_tensor_prefix") from None
    return SetTensorHeader(tensor_from_container(c.tensor), c.cache_flag if v7 else None, c.offset, hsize,
                           total - hsize)


def encode_set_tensor(tensor: RpcTensor, offset: int, data: Buffer, *, version: Iterable[int] | None = None,
                      cache_flag: int = 0) -> bytes:
    """A SET_TENSOR payload (wrap with :func:`encode_request`)."""
    flag = bytes((cache_flag,)) if at_least(normalize_version(version), 7) else b""
    return encode_rpc_tensor(tensor) + flag + _U64.pack(offset) + bytes(data)


def _plain(obj: Any) -> Any:
    if isinstance(obj, Container):
        return {k: _plain(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, ListContainer):
        return [_plain(x) for x in obj]
    return obj


def _parse_fixed(layout: Construct, payload: Buffer, what: str, rule: str) -> dict[str, Any]:
    if len(payload) != layout.sizeof():
        # Upstream closes the connection when a fixed-size message has any other size.
        raise MalformedPayload(f"{what} payload of {len(payload)} bytes, expected {layout.sizeof()}", rule=rule)
    try:
        return _plain(layout.parse(bytes(payload)))
    except ConstructError as e:  # pragma: no cover - sizes already match
        raise MalformedPayload(f"{what}: {e}", rule=rule) from None


def parse_request_payload(cmd: int, payload: Buffer, version: Iterable[int] | None = None,
                          fork: str | None = None) -> dict[str, Any]:
    """Fields of a request payload by name (SET_TENSOR: the header; GRAPH_COMPUTE: all)."""
    if cmd == Cmd.SET_TENSOR:
        h = parse_set_tensor_header(payload, version=version)
        return {"tensor": h.tensor, "cache_flag": h.cache_flag, "offset": h.offset,
                "data_offset": h.data_offset, "data_len": h.data_len}
    if cmd == Cmd.GRAPH_COMPUTE:
        g = parse_graph_compute(payload, version)
        return {"device": g.device, "nodes": list(g.nodes), "tensors": list(g.tensors)}
    layout = request_layout(cmd, version, fork)
    if layout is None:
        raise MalformedPayload(f"no known request layout for cmd {cmd}", rule="ggml.unknown_cmd")
    return _parse_fixed(layout, payload, command_name(cmd, version, fork), "ggml.request_size")


def parse_response_payload(cmd: int, payload: Buffer, version: Iterable[int] | None = None,
                           fork: str | None = None) -> dict[str, Any]:
    if cmd == Cmd.GET_TENSOR:
        return {"data": bytes(payload)}
    layout = response_layout(cmd, version, fork)
    if layout is None:
        raise MalformedPayload(f"no known response layout for cmd {cmd}", rule="ggml.unknown_cmd")
    return _parse_fixed(layout, payload, command_name(cmd, version, fork), "ggml.response_size")
