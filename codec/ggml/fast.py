"""``struct`` twins of the construct layouts, for the passthrough's hot path.

construct parses a GET_TENSOR request in tens of microseconds; the guard sees several fixed
requests per generated token. :func:`fast_layout` compiles a fixed construct ``Struct`` (the
source of truth) into one ``struct.Struct`` plus a plan that rebuilds the named fields, with
``rpc_tensor`` fields as :class:`RpcTensor`. A property test proves both parse alike.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from construct import Array, Bytes, Construct, FormatField, Renamed

from .tensor import RPC_TENSOR, RPC_TENSOR_STRUCT, Buffer, tensor_from_flat

_TENSOR_FIELDS = len(RPC_TENSOR_STRUCT.unpack(bytes(RPC_TENSOR_STRUCT.size)))


@dataclass(frozen=True, slots=True)
class FastLayout:
    struct: struct.Struct
    plan: tuple[tuple[str, str, int, int], ...]  # (name, kind, start, count) over the flat tuple

    @property
    def size(self) -> int:
        return self.struct.size

    def unpack(self, buf: Buffer, offset: int = 0) -> dict[str, Any]:
        flat = self.struct.unpack_from(buf, offset)
        out: dict[str, Any] = {}
        for name, kind, start, count in self.plan:
            if kind == "value":
                out[name] = flat[start]
            elif kind == "tensor":
                out[name] = tensor_from_flat(flat[start : start + _TENSOR_FIELDS])
            elif kind == "tensors":
                out[name] = tuple(tensor_from_flat(flat[i : i + _TENSOR_FIELDS])
                                  for i in range(start, start + count * _TENSOR_FIELDS, _TENSOR_FIELDS))
            else:  # "values"
                out[name] = flat[start : start + count]
        return out


def _piece(sc: Construct) -> tuple[str, str, int]:
    """(struct format, plan kind, count) of one top-level field's subconstruct."""
    if sc is RPC_TENSOR:
        return RPC_TENSOR_STRUCT.format.lstrip("<"), "tensor", 1
    if isinstance(sc, FormatField):
        return sc.fmtstr.lstrip("<"), "value", 1
    if isinstance(sc, Bytes) and isinstance(sc.length, int):
        return f"{sc.length}s", "value", 1
    if isinstance(sc, Array) and isinstance(sc.count, int):
        inner, kind, _ = _piece(sc.subcon)
        if kind == "tensor":
            return inner * sc.count, "tensors", sc.count
        if isinstance(sc.subcon, FormatField):
            return f"{sc.count}{inner}", "values", sc.count
    raise TypeError(f"no struct twin for {sc!r}")


@lru_cache(maxsize=128)
def fast_layout(layout: Construct) -> FastLayout:
    """Compile a fixed-size construct ``Struct`` of named fields (as :mod:`.commands` builds them)."""
    fmt, plan, pos = "<", [], 0
    for field in layout.subcons:
        if not isinstance(field, Renamed):
            raise TypeError(f"unnamed field in {layout!r}")
        piece, kind, count = _piece(field.subcon)
        fmt += piece
        plan.append((field.name, kind, pos, count))
        pos += {"tensor": _TENSOR_FIELDS, "tensors": count * _TENSOR_FIELDS, "values": count}.get(kind, 1)
    compiled = struct.Struct(fmt)
    if compiled.size != layout.sizeof():  # pragma: no cover - a layout this compiler misreads
        raise TypeError(f"struct twin of {layout!r} is {compiled.size} bytes, the layout {layout.sizeof()}")
    return FastLayout(compiled, tuple(plan))
