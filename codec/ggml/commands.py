"""Commands, protocol versions and forks: which commands exist, what they carry, who answers.

What each command carries and whether it is answered changed across protocol versions and
forks (docs/ggml.md has the table), so everything version-dependent goes through
:func:`command_table`. ``version=None`` means the pre-HELLO protocol ("v0", final layout of
2025-03-28: SET_TENSOR_HASH = 7, every command answered); a version tuple is what the HELLO
response reported.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

from construct import Array, Bytes, Construct, Int8ul, Int32ul, Int64ul, Struct

from ..errors import LocalProtocolError
from .tensor import GGML_MAX_DIMS, GGML_MAX_NAME, GGML_MAX_SRC, RPC_TENSOR

Version = tuple[int, int, int]
CONN_CAPS_SIZE = 24


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


def normalize_version(version: Iterable[int] | None) -> Version | None:
    """``(4,)`` → ``(4, 0, 0)``; each part must be a u8 (the HELLO response carries bytes)."""
    if version is None:
        return None
    v = tuple(version)
    if not 1 <= len(v) <= 3 or not all(isinstance(x, int) and 0 <= x <= 255 for x in v):
        raise LocalProtocolError(f"bad protocol version {version!r}", rule="ggml.version")
    return (v + (0, 0))[:3]  # type: ignore[return-value]


def at_least(v: Version | None, *ref: int) -> bool:
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
    return _request_layout(cmd, normalize_version(version), _fork(fork))


@lru_cache(maxsize=256)  # one object per (cmd, version, fork), so compiled twins can be cached by it
def _request_layout(cmd: int, v: Version | None, fork: str | None) -> Construct | None:
    dev = (_DEVICE,) if at_least(v, 3) else ()
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
        Cmd.GET_ALLOC_SIZE: Struct(*dev, "tensor" / RPC_TENSOR, *((_SRCS,) if at_least(v, 3, 6) else ())),
    }
    if v is not None:
        layouts[Cmd.HELLO] = HELLO_REQUEST if at_least(v, 4) else _EMPTY
    if at_least(v, 3):
        layouts[Cmd.DEVICE_COUNT] = _EMPTY
    if at_least(v, 3, 5):
        layouts[Cmd.GRAPH_RECOMPUTE] = Struct(_DEVICE)
    if at_least(v, 5):
        layouts[Cmd.MEMSET_TENSOR] = Struct("tensor" / RPC_TENSOR, "offset" / Int64ul, "size" / Int64ul,
                                            "value" / Int8ul)
    if at_least(v, 7, 0, 1):
        layouts[Cmd.GET_DEVICE_SUPPORTS_OP] = Struct(_DEVICE, "tensor" / RPC_TENSOR, _SRCS)
    return layouts.get(cmd)


def response_layout(cmd: int, version: Iterable[int] | None = None, fork: str | None = None) -> Construct | None:
    """The fixed response layout (an empty Struct for an empty reply); None if variable/unknown."""
    return _response_layout(cmd, normalize_version(version), _fork(fork))


@lru_cache(maxsize=256)
def _response_layout(cmd: int, v: Version | None, fork: str | None) -> Construct | None:
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
        layouts[Cmd.HELLO] = HELLO_RESPONSE if at_least(v, 4) else HELLO_RESPONSE_LEGACY
    if at_least(v, 3):
        layouts[Cmd.DEVICE_COUNT] = Struct("device_count" / Int32ul)
    if at_least(v, 5):
        layouts[Cmd.MEMSET_TENSOR] = _EMPTY
    if at_least(v, 7, 0, 1):
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
        return not at_least(v, 2)
    if cmd == Cmd.GRAPH_COMPUTE:
        return not at_least(v, 3, 5)
    if cmd == Cmd.GRAPH_RECOMPUTE:
        return False
    if cmd in (Cmd.FREE_BUFFER, Cmd.BUFFER_CLEAR, Cmd.INIT_TENSOR, Cmd.MEMSET_TENSOR):
        return not at_least(v, 6)
    return True


def _present(cmd: int, v: Version | None) -> bool:
    since = {Cmd.HELLO: (1,), Cmd.DEVICE_COUNT: (3,), Cmd.GRAPH_RECOMPUTE: (3, 5), Cmd.MEMSET_TENSOR: (5,),
             Cmd.GET_DEVICE_SUPPORTS_OP: (7, 0, 1)}.get(cmd)
    return cmd != Cmd.NONE and (since is None or at_least(v, *since))


def _size(layout: Construct | None) -> int | None:
    return None if layout is None else layout.sizeof()


@lru_cache(maxsize=64)
def _table(v: Version | None, fork: str | None) -> Mapping[int, CommandInfo]:
    table: dict[int, CommandInfo] = {}
    for cmd in Cmd:
        if _present(cmd, v):
            has = _answered(cmd, v) or fork == "llama-box"  # llama-box answers everything
            resp = _size(_response_layout(cmd, v, fork)) if has else None
            table[cmd] = CommandInfo(int(cmd), cmd.name, has, _size(_request_layout(cmd, v, fork)), resp)
    if fork == "ddvnguyen":
        table[RESOLVE_TENSOR] = CommandInfo(RESOLVE_TENSOR, "RESOLVE_TENSOR", True, GGML_MAX_NAME,
                                            RESOLVE_TENSOR_RESPONSE.sizeof())
    elif fork == "llama-box":
        table[SUPPORT_OP] = CommandInfo(SUPPORT_OP, "SUPPORT_OP", True, None, None)
    return MappingProxyType(table)


def command_table(version: Iterable[int] | None = None, fork: str | None = None) -> Mapping[int, CommandInfo]:
    """Commands that exist at ``version`` (None = pre-HELLO v0) for ``fork`` (None = upstream,
    "ddvnguyen"/"hydra", "llama-box"/"gpustack"), with whether each gets a response and the
    fixed payload sizes. SET_TENSOR is unanswered since 2.0.0, GRAPH_COMPUTE since
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


