"""ggml-RPC wire format (docs/protocol.md §14), sans-IO, for the passthrough and inspector.

Framing (little-endian, packed, no status, no request id; responses match requests FIFO)::

    request   [u8 cmd][u64 size][payload]
    response  [u64 size][payload]        — only for commands that get one at that version

What each command carries and whether it is answered changed across protocol versions and
forks, so everything version-dependent goes through :func:`command_table`. ``version=None``
means the pre-HELLO protocol ("v0", final layout of 2025-03-28: SET_TENSOR_HASH = 7, every
command answered); a version tuple is what the HELLO response reported.
"""
from __future__ import annotations

import enum
import struct
import sys
from array import array
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Any, Literal

from construct import (
    Array,
    Bytes,
    Construct,
    ConstructError,
    Container,
    Int8ul,
    Int32sl,
    Int32ul,
    Int64ul,
    ListContainer,
    Struct,
    Terminated,
    this,
)

from .errors import FrameTooLarge, LocalProtocolError, MalformedPayload, RemoteProtocolError, Truncated

Buffer = bytes | bytearray | memoryview
Version = tuple[int, int, int]


class Cmd(enum.IntEnum):
    """Upstream command bytes at the current numbering."""

    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    SET_TENSOR_HASH = 7
    GET_TENSOR = 8
    COPY_TENSOR = 9
    GRAPH_COMPUTE = 10
    GET_DEVICE_MEMORY = 11
    INIT_TENSOR = 12
    GET_ALLOC_SIZE = 13
    HELLO = 14  # static_assert'ed upstream: never moves
    DEVICE_COUNT = 15  # 3.0.0
    GRAPH_RECOMPUTE = 16  # 3.5.0
    MEMSET_TENSOR = 17  # 5.0.0
    NONE = 18  # 6.x client-internal marker; a server closes on it, so it is in no table
    GET_DEVICE_SUPPORTS_OP = 19  # 7.0.1


# Forks reuse values ≥ 15. Request/response layouts known only for the Hydra fork.
FORKS = ("ddvnguyen", "llama-box")
_FORK_ALIASES = {None: None, "upstream": None, "ddvnguyen": "ddvnguyen", "hydra": "ddvnguyen",
                 "llama-box": "llama-box", "gpustack": "llama-box"}
RESOLVE_TENSOR = 17  # ddvnguyen fork 4.1.0 (collides with MEMSET_TENSOR)
SUPPORT_OP = 15  # gpustack llama-box (collides with DEVICE_COUNT)
# Before 2025-03-28 SET_TENSOR_HASH did not exist and 7.. were numbered one lower.
V0_PRE_HASH_NAMES = {7: "GET_TENSOR", 8: "COPY_TENSOR", 9: "GRAPH_COMPUTE", 10: "GET_DEVICE_MEMORY",
                     11: "INIT_TENSOR", 12: "GET_ALLOC_SIZE"}

# ---- rpc_tensor (296 bytes) ------------------------------------------------------------------

GGML_MAX_DIMS = 4
GGML_MAX_OP_PARAMS_I32 = 16
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64
CONN_CAPS_SIZE = 24

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
_RPC_TENSOR = struct.Struct("<QIQ4I4II16ii10QQQQ64si")
RPC_TENSOR_SIZE = _RPC_TENSOR.size
assert RPC_TENSOR.sizeof() == RPC_TENSOR_SIZE == 296


@dataclass(frozen=True, slots=True)
class RpcTensor:
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


def _tensor_from_flat(v: tuple[Any, ...]) -> RpcTensor:
    # field order of _RPC_TENSOR: id type buffer ne×4 nb×4 op op_params×16 flags src×10 …
    return RpcTensor(v[0], v[1], v[2], v[3:7], v[7:11], v[11], v[12:28], v[28], v[29:39], v[39], v[40], v[41], v[42], v[43])


def parse_rpc_tensor(buf: Buffer, offset: int = 0) -> RpcTensor:
    if len(buf) - offset < RPC_TENSOR_SIZE or offset < 0:
        raise Truncated(f"rpc_tensor needs {RPC_TENSOR_SIZE} bytes", rule="ggml.tensor_short")
    return _tensor_from_flat(_RPC_TENSOR.unpack_from(buf, offset))


def _tensor_from_container(c: Any) -> RpcTensor:
    return RpcTensor(c.id, c.type, c.buffer, tuple(c.ne), tuple(c.nb), c.op, tuple(c.op_params), c.flags,
                     tuple(c.src), c.view_src, c.view_offs, c.data, c.name, c.use_count)


def parse_rpc_tensor_construct(buf: Buffer, offset: int = 0) -> RpcTensor:
    try:
        c = RPC_TENSOR.parse(bytes(buf[offset:]) if offset >= 0 else b"")
    except ConstructError as e:
        raise Truncated(f"rpc_tensor: {e}", rule="ggml.tensor_short") from None
    return _tensor_from_container(c)


def encode_rpc_tensor(t: RpcTensor) -> bytes:
    name = t.name.encode() if isinstance(t.name, str) else t.name
    try:
        return _RPC_TENSOR.pack(t.id, t.type, t.buffer, *t.ne, *t.nb, t.op, *t.op_params, t.flags, *t.src,
                                t.view_src, t.view_offs, t.data, name.ljust(GGML_MAX_NAME, b"\0"), t.use_count)
    except struct.error as e:
        raise LocalProtocolError(f"rpc_tensor field out of range: {e}", rule="ggml.tensor") from None


# ---- versions and the command table ---------------------------------------------------------


def normalize_version(version: Iterable[int] | None) -> Version | None:
    """``(4,)`` → ``(4, 0, 0)``; each part must be a u8 (the HELLO response carries bytes)."""
    if version is None:
        return None
    v = tuple(version)
    if not 1 <= len(v) <= 3 or not all(isinstance(x, int) and 0 <= x <= 255 for x in v):
        raise LocalProtocolError(f"bad protocol version {version!r}", rule="ggml.version")
    return (v + (0, 0))[:3]  # type: ignore[return-value]


def _at_least(v: Version | None, *ref: int) -> bool:
    return v is not None and v >= ref


_DEVICE = "device" / Int32ul
_EMPTY = Struct()
_SRCS = "srcs" / Array(GGML_MAX_SRC, RPC_TENSOR)
HELLO_REQUEST = Struct("conn_caps" / Bytes(CONN_CAPS_SIZE))
HELLO_RESPONSE = Struct("major" / Int8ul, "minor" / Int8ul, "patch" / Int8ul, "padding" / Int8ul,
                        "conn_caps" / Bytes(CONN_CAPS_SIZE))
HELLO_RESPONSE_LEGACY = Struct("major" / Int8ul, "minor" / Int8ul, "patch" / Int8ul)
RESOLVE_TENSOR_REQUEST = Struct("name" / Bytes(GGML_MAX_NAME))
RESOLVE_TENSOR_RESPONSE = Struct(
    "found" / Int8ul, "registry_epoch" / Int32ul, "type" / Int32ul, "ne" / Array(GGML_MAX_DIMS, Int32ul),
    "nb" / Array(GGML_MAX_DIMS, Int32ul), "buffer" / Int64ul, "buffer_size" / Int64ul, "data" / Int64ul,
)
_U8_RESULT = Struct("result" / Int8ul)


def request_layout(cmd: int, version: Iterable[int] | None = None, fork: str | None = None) -> Construct | None:
    """The fixed request layout of ``cmd``; None for variable (SET_TENSOR, GRAPH_COMPUTE) or unknown."""
    v, fork = normalize_version(version), _fork(fork)
    dev = (_DEVICE,) if _at_least(v, 3) else ()
    if fork == "ddvnguyen" and cmd == RESOLVE_TENSOR:
        return RESOLVE_TENSOR_REQUEST
    if fork == "llama-box" and cmd == SUPPORT_OP:
        return None
    layouts: dict[int, Construct] = {
        Cmd.ALLOC_BUFFER: Struct(*dev, "size" / Int64ul),
        Cmd.GET_ALIGNMENT: Struct(*dev),
        Cmd.GET_MAX_SIZE: Struct(*dev),
        Cmd.BUFFER_GET_BASE: Struct("remote_ptr" / Int64ul),
        Cmd.FREE_BUFFER: Struct("remote_ptr" / Int64ul),
        Cmd.BUFFER_CLEAR: Struct("remote_ptr" / Int64ul, "value" / Int8ul),
        Cmd.SET_TENSOR_HASH: Struct("tensor" / RPC_TENSOR, "offset" / Int64ul, "hash" / Int64ul),
        Cmd.GET_TENSOR: Struct("tensor" / RPC_TENSOR, "offset" / Int64ul, "size" / Int64ul),
        Cmd.COPY_TENSOR: Struct("src" / RPC_TENSOR, "dst" / RPC_TENSOR),
        Cmd.GET_DEVICE_MEMORY: Struct(*dev),
        Cmd.INIT_TENSOR: Struct("tensor" / RPC_TENSOR),
        Cmd.GET_ALLOC_SIZE: Struct(*dev, "tensor" / RPC_TENSOR, *((_SRCS,) if _at_least(v, 3, 6) else ())),
    }
    if v is not None:
        layouts[Cmd.HELLO] = HELLO_REQUEST if _at_least(v, 4) else _EMPTY
    if _at_least(v, 3):
        layouts[Cmd.DEVICE_COUNT] = _EMPTY
    if _at_least(v, 3, 5):
        layouts[Cmd.GRAPH_RECOMPUTE] = Struct(_DEVICE)
    if _at_least(v, 5):
        layouts[Cmd.MEMSET_TENSOR] = Struct("tensor" / RPC_TENSOR, "offset" / Int64ul, "size" / Int64ul,
                                            "value" / Int8ul)
    if _at_least(v, 7, 0, 1):
        layouts[Cmd.GET_DEVICE_SUPPORTS_OP] = Struct(_DEVICE, "tensor" / RPC_TENSOR, _SRCS)
    return layouts.get(cmd)


def response_layout(cmd: int, version: Iterable[int] | None = None, fork: str | None = None) -> Construct | None:
    """The fixed response layout (an empty Struct for an empty reply); None if variable/unknown."""
    v, fork = normalize_version(version), _fork(fork)
    if fork == "ddvnguyen" and cmd == RESOLVE_TENSOR:
        return RESOLVE_TENSOR_RESPONSE
    if fork == "llama-box" and cmd == SUPPORT_OP:
        return None
    layouts: dict[int, Construct] = {
        Cmd.ALLOC_BUFFER: Struct("remote_ptr" / Int64ul, "remote_size" / Int64ul),
        Cmd.GET_ALIGNMENT: Struct("alignment" / Int64ul),
        Cmd.GET_MAX_SIZE: Struct("max_size" / Int64ul),
        Cmd.BUFFER_GET_BASE: Struct("base_ptr" / Int64ul),
        Cmd.FREE_BUFFER: _EMPTY,
        Cmd.BUFFER_CLEAR: _EMPTY,
        Cmd.SET_TENSOR: _EMPTY,  # answered (empty) only before 2.0.0
        Cmd.SET_TENSOR_HASH: _U8_RESULT,
        Cmd.COPY_TENSOR: _U8_RESULT,
        Cmd.GRAPH_COMPUTE: _U8_RESULT,  # answered only before 3.5.0
        Cmd.GET_DEVICE_MEMORY: Struct("free_mem" / Int64ul, "total_mem" / Int64ul),
        Cmd.INIT_TENSOR: _EMPTY,
        Cmd.GET_ALLOC_SIZE: Struct("alloc_size" / Int64ul),
    }
    if v is not None:
        layouts[Cmd.HELLO] = HELLO_RESPONSE if _at_least(v, 4) else HELLO_RESPONSE_LEGACY
    if _at_least(v, 3):
        layouts[Cmd.DEVICE_COUNT] = Struct("device_count" / Int32ul)
    if _at_least(v, 5):
        layouts[Cmd.MEMSET_TENSOR] = _EMPTY
    if _at_least(v, 7, 0, 1):
        layouts[Cmd.GET_DEVICE_SUPPORTS_OP] = Struct("supported" / Int8ul)
    return layouts.get(cmd)


@dataclass(frozen=True, slots=True)
class CommandInfo:
    cmd: int
    name: str
    has_response: bool
    request_size: int | None  # fixed payload size; None = variable or unknown
    response_size: int | None  # fixed response payload size; None = variable, unknown, or no response


def _fork(fork: str | None) -> str | None:
    try:
        return _FORK_ALIASES[fork]
    except KeyError:
        raise LocalProtocolError(f"unknown ggml-rpc fork {fork!r}", rule="ggml.fork") from None


def _answered(cmd: int, v: Version | None) -> bool:
    if cmd == Cmd.SET_TENSOR:
        return not _at_least(v, 2)
    if cmd == Cmd.GRAPH_COMPUTE:
        return not _at_least(v, 3, 5)
    if cmd == Cmd.GRAPH_RECOMPUTE:
        return False
    if cmd in (Cmd.FREE_BUFFER, Cmd.BUFFER_CLEAR, Cmd.INIT_TENSOR, Cmd.MEMSET_TENSOR):
        return not _at_least(v, 6)
    return True


def _present(cmd: int, v: Version | None) -> bool:
    since = {Cmd.HELLO: (1,), Cmd.DEVICE_COUNT: (3,), Cmd.GRAPH_RECOMPUTE: (3, 5), Cmd.MEMSET_TENSOR: (5,),
             Cmd.GET_DEVICE_SUPPORTS_OP: (7, 0, 1)}.get(cmd)
    return cmd != Cmd.NONE and (since is None or _at_least(v, *since))


def _size(layout: Construct | None) -> int | None:
    return None if layout is None else layout.sizeof()


@lru_cache(maxsize=64)
def _table(v: Version | None, fork: str | None) -> Mapping[int, CommandInfo]:
    table: dict[int, CommandInfo] = {}
    for cmd in Cmd:
        if _present(cmd, v):
            has = _answered(cmd, v) or fork == "llama-box"  # llama-box answers everything
            resp = _size(response_layout(cmd, v, fork)) if has else None
            table[cmd] = CommandInfo(int(cmd), cmd.name, has, _size(request_layout(cmd, v, fork)), resp)
    if fork == "ddvnguyen":
        table[RESOLVE_TENSOR] = CommandInfo(RESOLVE_TENSOR, "RESOLVE_TENSOR", True, GGML_MAX_NAME,
                                            RESOLVE_TENSOR_RESPONSE.sizeof())
    elif fork == "llama-box":
        table[SUPPORT_OP] = CommandInfo(SUPPORT_OP, "SUPPORT_OP", True, None, None)
    return MappingProxyType(table)


def command_table(version: Iterable[int] | None = None, fork: str | None = None) -> Mapping[int, CommandInfo]:
    """Commands that exist at ``version`` (None = pre-HELLO v0) for ``fork`` (None = upstream,
    "ddvnguyen"/"hydra", "llama-box"/"gpustack"), with whether each gets a response and the
    fixed payload sizes. By version: SET_TENSOR unanswered since 2.0.0, GRAPH_COMPUTE since
    3.5.0, FREE_BUFFER/BUFFER_CLEAR/INIT_TENSOR/MEMSET_TENSOR since 6.0.0.
    """
    return _table(normalize_version(version), _fork(fork))


def command_name(cmd: int, version: Iterable[int] | None = None, fork: str | None = None) -> str:
    info = command_table(version, fork).get(cmd)
    return info.name if info else f"0x{cmd:02X}"


def layout_fields(layout: Construct) -> list[tuple[str, int, int]]:
    """``[(name, offset, size)]`` of a fixed-size Struct's top-level fields (for the inspector)."""
    out, offset = [], 0
    for sc in layout.subcons:
        size = sc.sizeof()
        out.append((sc.name or "", offset, size))
        offset += size
    return out


# ---- framing ---------------------------------------------------------------------------------

REQUEST_HEADER = Struct("cmd" / Int8ul, "size" / Int64ul)
RESPONSE_HEADER = Struct("size" / Int64ul)
_REQ_HEADER = struct.Struct("<BQ")
_RSP_HEADER = struct.Struct("<Q")


def encode_request(cmd: int, payload: Buffer = b"") -> bytes:
    if not 0 <= cmd <= 0xFF:
        raise LocalProtocolError(f"cmd {cmd} is not a byte", rule="ggml.cmd")
    return _REQ_HEADER.pack(cmd, len(payload)) + bytes(payload)


def encode_response(payload: Buffer = b"") -> bytes:
    return _RSP_HEADER.pack(len(payload)) + bytes(payload)


@dataclass(frozen=True, slots=True)
class RequestHeader:
    cmd: int
    size: int


@dataclass(frozen=True, slots=True)
class ResponseHeader:
    cmd: int  # the request it answers (FIFO)
    size: int
    expected_size: int | None  # from the command table; a mismatch makes the real client abort


@dataclass(frozen=True, slots=True)
class PayloadChunk:
    data: bytes  # only for payloads larger than the decoder's max_buffered


@dataclass(frozen=True, slots=True)
class RequestComplete:
    cmd: int
    size: int
    payload: bytes | None  # None when it was emitted as PayloadChunks


@dataclass(frozen=True, slots=True)
class ResponseComplete:
    cmd: int
    size: int
    payload: bytes | None


DEFAULT_MAX_BUFFERED = 1 << 20


class _FrameDecoder:
    """Header, then payload bytes passed through without ever holding a big payload whole."""

    _HEADER: struct.Struct

    def __init__(self, max_buffered: int, max_size: int | None) -> None:
        self.max_buffered = max_buffered
        self.max_size = max_size
        self._hdr = bytearray()
        self._remaining: int | None = None  # None = reading a header
        self._collect: bytearray | None = None

    @property
    def in_frame(self) -> bool:
        return bool(self._hdr) or self._remaining is not None

    def eof(self) -> None:
        """Call at end of stream: stopping inside a frame is Truncated."""
        pending = getattr(self, "_pending_error", None)
        if pending is not None:
            raise pending
        if self.in_frame:
            raise Truncated("stream ended inside a ggml-rpc frame", rule="ggml.eof")

    def _feed(self, data: Buffer) -> list[Any]:
        # A refused frame found after complete ones in the same feed() is raised on the
        # next call, so the frames before it are never lost.
        pending = getattr(self, "_pending_error", None)
        if pending is not None:
            raise pending
        events: list[Any] = []
        mv = memoryview(data).cast("B")
        pos, n, hsize = 0, len(mv), self._HEADER.size
        while True:
            if self._remaining is None:
                if pos >= n:
                    break
                take = min(hsize - len(self._hdr), n - pos)
                self._hdr += mv[pos : pos + take]
                pos += take
                if len(self._hdr) < hsize:
                    break
                fields = self._HEADER.unpack(self._hdr)
                self._hdr.clear()
                size = fields[-1]
                if self.max_size is not None and size > self.max_size:
                    err = FrameTooLarge(f"ggml-rpc frame of {size} bytes > {self.max_size}", rule="ggml.size")
                    err.recoverable = False
                    if events:
                        self._pending_error = err
                        return events
                    raise err
                events.append(self._on_header(fields))
                self._remaining = size
                self._collect = bytearray() if size <= self.max_buffered else None
            if self._remaining:
                take = min(self._remaining, n - pos)
                if take == 0:
                    break
                if self._collect is not None:
                    self._collect += mv[pos : pos + take]
                else:
                    events.append(PayloadChunk(bytes(mv[pos : pos + take])))
                pos += take
                self._remaining -= take
            if self._remaining == 0:
                payload = bytes(self._collect) if self._collect is not None else None
                self._remaining, self._collect = None, None
                events.append(self._on_end(payload))
        return events

    def _on_header(self, fields: tuple[int, ...]) -> Any:
        raise NotImplementedError

    def _on_end(self, payload: bytes | None) -> Any:
        raise NotImplementedError


class GgmlRequestDecoder(_FrameDecoder):
    """Client → server: ``feed(bytes) -> [RequestHeader, PayloadChunk…, RequestComplete, …]``.

    Payloads up to ``max_buffered`` arrive whole in RequestComplete; larger ones as chunks.
    ``max_size`` (optional) refuses a frame before any of it is read (FrameTooLarge).
    """

    _HEADER = _REQ_HEADER

    def __init__(self, *, max_buffered: int = DEFAULT_MAX_BUFFERED, max_size: int | None = None) -> None:
        super().__init__(max_buffered, max_size)
        self._cmd = 0
        self._size = 0

    def feed(self, data: Buffer) -> list[Any]:
        return self._feed(data)

    def _on_header(self, fields: tuple[int, ...]) -> RequestHeader:
        self._cmd, self._size = fields
        return RequestHeader(self._cmd, self._size)

    def _on_end(self, payload: bytes | None) -> RequestComplete:
        return RequestComplete(self._cmd, self._size, payload)


class GgmlResponseDecoder(_FrameDecoder):
    """Server → client. Responses carry no command, so the decoder keeps the FIFO of requests
    sent (``feed(data, expected_cmds)`` or :meth:`expect`) and, when a response arrives, skips
    the ones that get no reply under the current table — evaluated at that moment, so requests
    queued before the HELLO response are judged by the negotiated version. A command the table
    does not know is assumed answered (forks add commands). After a HELLO response the table
    switches to the reported version (``auto_version``).
    """

    _HEADER = _RSP_HEADER

    def __init__(
        self,
        version: Iterable[int] | None = None,
        fork: str | None = None,
        *,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
        max_size: int | None = None,
        auto_version: bool = True,
    ) -> None:
        super().__init__(max_buffered, max_size)
        self.fork = fork
        self.version = normalize_version(version)
        self.table = command_table(self.version, fork)
        self.auto_version = auto_version
        self.pending: deque[int] = deque()
        self._cmd = 0
        self._size = 0

    def expect(self, cmd: int) -> None:
        self.pending.append(cmd)

    def set_version(self, version: Iterable[int] | None) -> None:
        self.version = normalize_version(version)
        self.table = command_table(self.version, self.fork)

    def feed(self, data: Buffer, expected_cmds: Iterable[int] = ()) -> list[Any]:
        self.pending.extend(expected_cmds)
        return self._feed(data)

    def _on_header(self, fields: tuple[int, ...]) -> ResponseHeader:
        while self.pending:
            cmd = self.pending.popleft()
            info = self.table.get(cmd)
            if info is None or info.has_response:
                self._cmd, self._size = cmd, fields[0]
                return ResponseHeader(cmd, fields[0], info.response_size if info else None)
        err = RemoteProtocolError("response with no request awaiting one", rule="ggml.unsolicited")
        err.recoverable = False
        raise err

    def _on_end(self, payload: bytes | None) -> ResponseComplete:
        if self.auto_version and self._cmd == Cmd.HELLO and payload is not None:
            try:
                self.set_version(parse_hello_response(payload).version)
            except MalformedPayload:
                pass  # the header event already showed the size mismatch
        return ResponseComplete(self._cmd, self._size, payload)


# ---- HELLO -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HelloResponse:
    version: Version
    caps: bytes | None  # None for a legacy (1.x–3.x) 3-byte response
    padding: int = 0


def _caps(caps: Buffer | None) -> bytes:
    caps = bytes(CONN_CAPS_SIZE) if caps is None else bytes(caps)
    if len(caps) != CONN_CAPS_SIZE:
        raise LocalProtocolError(f"conn_caps must be {CONN_CAPS_SIZE} bytes", rule="ggml.caps")
    return caps


def encode_hello_request(caps: Buffer | None = None, *, legacy: bool = False) -> bytes:
    """Whole HELLO frame: ``0E 18 00…00`` + caps (4.0+), or ``0E`` + 8 zero bytes (1.x–3.x)."""
    if legacy:
        if caps is not None:
            raise LocalProtocolError("a legacy HELLO carries no caps", rule="ggml.caps")
        return encode_request(Cmd.HELLO)
    return encode_request(Cmd.HELLO, _caps(caps))


def parse_hello_request(payload: Buffer) -> bytes | None:
    """The client's conn_caps (24-byte payload), or None for a legacy empty HELLO."""
    if len(payload) == 0:
        return None
    if len(payload) != CONN_CAPS_SIZE:
        raise MalformedPayload(f"HELLO request of {len(payload)} bytes (0 or 24)", rule="ggml.hello_size")
    return bytes(payload)


def encode_hello_response(version: Iterable[int], caps: Buffer | None = None) -> bytes:
    """Whole HELLO response frame; 28-byte payload for major ≥ 4, else the 3-byte legacy one."""
    v = normalize_version(version)
    assert v is not None
    if v[0] >= 4:
        return encode_response(bytes((*v, 0)) + _caps(caps))
    if caps is not None:
        raise LocalProtocolError("a legacy HELLO response carries no caps", rule="ggml.caps")
    return encode_response(bytes(v))


def parse_hello_response(payload: Buffer) -> HelloResponse:
    if len(payload) == 28:
        return HelloResponse((payload[0], payload[1], payload[2]), bytes(payload[4:]), payload[3])
    if len(payload) == 3:
        return HelloResponse((payload[0], payload[1], payload[2]), None)
    raise MalformedPayload(f"HELLO response of {len(payload)} bytes (3 or 28)", rule="ggml.hello_size")


# ---- parse any fixed request/response payload ------------------------------------------------


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


# ---- GRAPH_COMPUTE ---------------------------------------------------------------------------

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
    has_device = _at_least(normalize_version(version), 3)
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
    tensors = tuple(_tensor_from_flat(t) for t in _RPC_TENSOR.iter_unpack(payload[off : off + need]))
    return GraphCompute(device, tuple(nodes), tensors)


def parse_graph_compute_construct(payload: Buffer, version: Iterable[int] | None = None) -> GraphCompute:
    has_device = _at_least(normalize_version(version), 3)
    try:
        c = (GRAPH_COMPUTE if has_device else GRAPH_COMPUTE_PRE3).parse(bytes(payload))
    except ConstructError as e:
        raise MalformedPayload(f"GRAPH_COMPUTE: {e}", rule="ggml.graph_construct") from None
    tensors = tuple(_tensor_from_container(t) for t in c.tensors)
    return GraphCompute(c.device if has_device else None, tuple(c.nodes), tensors)


def encode_graph_compute(nodes: Iterable[int], tensors: Iterable[RpcTensor], *, device: int | None = 0,
                         version: Iterable[int] | None = (3, 6, 1)) -> bytes:
    nodes, tensors = list(nodes), list(tensors)
    head = _U32.pack(device or 0) if _at_least(normalize_version(version), 3) else b""
    try:
        node_bytes = struct.pack(f"<{len(nodes)}Q", *nodes)
    except struct.error as e:
        raise LocalProtocolError(f"node id out of range: {e}", rule="ggml.graph") from None
    return b"".join((head, _U32.pack(len(nodes)), node_bytes, _U32.pack(len(tensors)),
                     *map(encode_rpc_tensor, tensors)))


# ---- SET_TENSOR header ----------------------------------------------------------------------

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
    return RPC_TENSOR_SIZE + (1 if _at_least(normalize_version(version), 7) else 0) + 8


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
    v7 = _at_least(normalize_version(version), 7)
    hsize = set_tensor_header_size(version)
    total = len(prefix) if payload_size is None else payload_size
    if total < hsize:
        raise MalformedPayload(f"SET_TENSOR payload of {total} bytes < {hsize}", rule="ggml.set_tensor_short")
    try:
        c = (SET_TENSOR_HEAD_V7 if v7 else SET_TENSOR_HEAD).parse(bytes(prefix))
    except ConstructError as e:
        raise Truncated(f"SET_TENSOR head: {e}", rule="ggml.set_tensor_prefix") from None
    return SetTensorHeader(_tensor_from_container(c.tensor), c.cache_flag if v7 else None, c.offset, hsize,
                           total - hsize)


def encode_set_tensor(tensor: RpcTensor, offset: int, data: Buffer, *, version: Iterable[int] | None = None,
                      cache_flag: int = 0) -> bytes:
    """A SET_TENSOR payload (wrap with :func:`encode_request`)."""
    flag = bytes((cache_flag,)) if _at_least(normalize_version(version), 7) else b""
    return encode_rpc_tensor(tensor) + flag + _U64.pack(offset) + bytes(data)


# ---- first bytes of a connection ------------------------------------------------------------

FirstBytesKind = Literal["hydra", "ggml", "ggml_legacy", "unknown", "incomplete"]


def classify_first_bytes(b: Buffer) -> FirstBytesKind:
    """``59 48`` → hydra; ``0E`` → ggml; any other byte < 0x14 → ggml_legacy (pre-1.0 client);
    anything else → unknown. "incomplete" when too few bytes arrived to decide (``b""`` or a
    lone ``59``): read more, or treat as unknown once the deadline passes.
    """
    if len(b) == 0:
        return "incomplete"
    if b[0] == 0x59:
        if len(b) < 2:
            return "incomplete"
        return "hydra" if b[1] == 0x48 else "unknown"
    if b[0] == Cmd.HELLO:
        return "ggml"
    if b[0] < 0x14:
        return "ggml_legacy"
    return "unknown"


def classify_ggml_hello(first9: Buffer) -> Literal["hello", "hello_legacy", "bad", "incomplete"]:
    """The HELLO header's size: 24 (≥ 4.0), 0 (1.x–3.x), anything else is not a HELLO we know."""
    if len(first9) < 9:
        return "incomplete" if len(first9) == 0 or first9[0] == Cmd.HELLO else "bad"
    if first9[0] != Cmd.HELLO:
        return "bad"
    size = _U64.unpack_from(first9, 1)[0]
    return "hello" if size == CONN_CAPS_SIZE else "hello_legacy" if size == 0 else "bad"
