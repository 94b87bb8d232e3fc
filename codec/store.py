"""Store payloads (docs/protocol.md §13, C# StoreServer), mostly for the inspector.

Binary chunk records (all i32 little-endian, as C# ``BinaryPrimitives.WriteInt32LittleEndian``):

* GET_CHUNKED response payload: repeated ``[i32 index][i32 size][body]``
* PUSH_CHUNKS request payload:  repeated ``[i32 size][body]``

and JSON shapes: manifests (PUT_MANIFEST request, GET_MANIFEST response), LIST's array of
names, hash lists (GET_CHUNKED / SYNC_MISSING requests) and ``{"missing_hashes":[…]}``.
Chunk hashes are SHA-256 lowercase hex in practice; the codec only checks they are strings.
"""
from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from construct import Bytes, ConstructError, GreedyRange, Int32sl, Struct, Terminated, this

from .errors import FrameTooLarge, LocalProtocolError, MalformedPayload, Truncated
from .json_text import dumps_compact, loads_json, parse_json_object

INDEXED_CHUNK_HEAD = Struct("index" / Int32sl, "size" / Int32sl)
INDEXED_CHUNK = Struct("index" / Int32sl, "size" / Int32sl, "body" / Bytes(this.size))
GET_CHUNKED_PAYLOAD = Struct("chunks" / GreedyRange(INDEXED_CHUNK), Terminated)
SIZED_CHUNK_HEAD = Struct("size" / Int32sl)
SIZED_CHUNK = Struct("size" / Int32sl, "body" / Bytes(this.size))
PUSH_CHUNKS_PAYLOAD = Struct("chunks" / GreedyRange(SIZED_CHUNK), Terminated)

_INDEXED = struct.Struct("<ii")
_SIZED = struct.Struct("<i")
DEFAULT_CHUNK_SIZE = 8 * 1024 * 1024  # HYDRA_STORE_CHUNK_SIZE default (8192 KiB)
DEFAULT_MAX_CHUNK = 8 * DEFAULT_CHUNK_SIZE  # generous: servers may be configured larger

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    index: int | None  # None for PUSH_CHUNKS records, which carry no index
    offset: int  # of the body in the payload
    size: int
    body: memoryview  # a view into the payload, not a copy


def _iter_chunks(payload: Buffer, indexed: bool, max_chunk: int, max_chunks: int | None) -> Iterator[ChunkRecord]:
    head = _INDEXED if indexed else _SIZED
    mv = memoryview(payload).cast("B")
    pos, end, count = 0, len(mv), 0
    while pos < end:
        if end - pos < head.size:
            raise Truncated(f"{end - pos} trailing bytes < a {head.size}-byte chunk header", rule="store.chunk_header")
        if max_chunks is not None and count >= max_chunks:
            raise FrameTooLarge(f"more than {max_chunks} chunks", rule="store.chunk_count")
        if indexed:
            index, size = head.unpack_from(mv, pos)
            if index < 0:
                raise MalformedPayload(f"negative chunk index {index}", rule="store.chunk_index")
        else:
            index, (size,) = None, head.unpack_from(mv, pos)
        if size < 0:
            raise MalformedPayload(f"negative chunk size {size}", rule="store.chunk_size")
        if size > max_chunk:
            raise FrameTooLarge(f"chunk of {size} bytes > {max_chunk}", rule="store.chunk_size")
        body_at = pos + head.size
        if size > end - body_at:
            raise Truncated(f"chunk of {size} bytes, {end - body_at} left", rule="store.chunk_body")
        yield ChunkRecord(index, body_at, size, mv[body_at : body_at + size])
        pos = body_at + size
        count += 1


def iter_indexed_chunks(
    payload: Buffer, *, max_chunk: int = DEFAULT_MAX_CHUNK, max_chunks: int | None = None
) -> Iterator[ChunkRecord]:
    """GET_CHUNKED response records ``[i32 index][i32 size][body]``; errors raise when reached."""
    return _iter_chunks(payload, True, max_chunk, max_chunks)


def iter_sized_chunks(
    payload: Buffer, *, max_chunk: int = DEFAULT_MAX_CHUNK, max_chunks: int | None = None
) -> Iterator[ChunkRecord]:
    """PUSH_CHUNKS request records ``[i32 size][body]``."""
    return _iter_chunks(payload, False, max_chunk, max_chunks)


def parse_chunks_construct(payload: Buffer, *, indexed: bool) -> list[tuple[int | None, bytes]]:
    """Construct twin of the iterators (no limits): ``[(index, body), ...]``."""
    layout = GET_CHUNKED_PAYLOAD if indexed else PUSH_CHUNKS_PAYLOAD
    try:
        chunks = layout.parse(bytes(payload)).chunks
    except ConstructError as e:
        raise MalformedPayload(f"chunk records: {e}", rule="store.construct") from None
    out = [(c.index if indexed else None, c.body) for c in chunks]
    if indexed and any(i < 0 for i, _ in out):
        raise MalformedPayload("negative chunk index", rule="store.chunk_index")
    return out


def _i32_len(body: Buffer) -> int:
    if len(body) > 0x7FFFFFFF:
        raise LocalProtocolError("chunk longer than i32", rule="store.chunk_size")
    return len(body)


def encode_indexed_chunk(index: int, body: Buffer) -> bytes:
    if not 0 <= index <= 0x7FFFFFFF:
        raise LocalProtocolError(f"chunk index {index} not in i32 >= 0", rule="store.chunk_index")
    return _INDEXED.pack(index, _i32_len(body)) + bytes(body)


def encode_sized_chunk(body: Buffer) -> bytes:
    return _SIZED.pack(_i32_len(body)) + bytes(body)


# ---- JSON shapes -----------------------------------------------------------------------------


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, slots=True)
class ManifestChunk:
    index: int
    hash: str
    size: int


@dataclass(frozen=True, slots=True)
class Manifest:
    n_past: int | None
    total_size: int | None
    chunks: tuple[ManifestChunk, ...]
    model_alias: str | None = None
    model_hash: str | None = None
    model_path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys this codec does not know


_MANIFEST_KEYS = ("n_past", "total_size", "model_alias", "model_hash", "model_path", "chunks")


def parse_manifest(payload: Buffer) -> Manifest:
    """PUT_MANIFEST request / GET_MANIFEST response body. Empty → "manifest.empty"."""
    if len(payload) == 0:
        raise MalformedPayload("empty manifest", rule="manifest.empty")
    obj = parse_json_object(payload, "manifest.json")
    for key in ("n_past", "total_size"):
        v = obj.get(key)
        if v is not None and not (_is_int(v) and v >= 0):
            raise MalformedPayload(f"{key} must be an int >= 0 or null", rule=f"manifest.{key}")
    for key in ("model_alias", "model_hash", "model_path"):
        if obj.get(key) is not None and not isinstance(obj[key], str):
            raise MalformedPayload(f"{key} must be a string or null", rule="manifest.model")
    raw = obj.get("chunks")
    raw = [] if raw is None else raw
    if not isinstance(raw, list):
        raise MalformedPayload("chunks must be an array", rule="manifest.chunks")
    chunks = []
    for i, c in enumerate(raw):
        ok = (
            isinstance(c, dict)
            and _is_int(c.get("index")) and c["index"] >= 0
            and isinstance(c.get("hash"), str)
            and _is_int(c.get("size")) and c["size"] >= 0
        )
        if not ok:
            raise MalformedPayload(f"chunk {i} is not {{index, hash, size}}", rule="manifest.chunk")
        chunks.append(ManifestChunk(c["index"], c["hash"], c["size"]))
    extra = {k: v for k, v in obj.items() if k not in _MANIFEST_KEYS}
    return Manifest(
        obj.get("n_past"), obj.get("total_size"), tuple(chunks),
        obj.get("model_alias"), obj.get("model_hash"), obj.get("model_path"), extra,
    )


def encode_manifest(m: Manifest) -> bytes:
    obj: dict[str, Any] = {"n_past": m.n_past, "total_size": m.total_size}
    for key in ("model_alias", "model_hash", "model_path"):
        if getattr(m, key) is not None:
            obj[key] = getattr(m, key)
    obj["chunks"] = [{"index": c.index, "hash": c.hash, "size": c.size} for c in m.chunks]
    obj.update(m.extra)
    return dumps_compact(obj)


def _string_array(payload: Buffer, rule: str, *, allow_empty: bool) -> list[str]:
    if len(payload) == 0 and allow_empty:
        return []
    arr = loads_json(payload, rule)
    if not isinstance(arr, list) or not all(isinstance(x, str) for x in arr):
        raise MalformedPayload("expected a JSON array of strings", rule=rule)
    return arr


def parse_list_payload(payload: Buffer) -> list[str]:
    """LIST response payload: JSON array of object names."""
    return _string_array(payload, "store.list", allow_empty=False)


def encode_list_payload(names: list[str]) -> bytes:
    return dumps_compact(list(names))


def parse_hash_list(payload: Buffer) -> list[str]:
    """GET_CHUNKED / SYNC_MISSING request: JSON array of hashes (empty payload → [])."""
    return _string_array(payload, "store.hashes", allow_empty=True)


def parse_missing_hashes(payload: Buffer) -> list[str]:
    """SYNC_MISSING response and PUT_MANIFEST PARTIAL payload ``{"missing_hashes":[…]}``."""
    obj = parse_json_object(payload, "store.missing_hashes")
    arr = obj.get("missing_hashes")
    if not isinstance(arr, list) or not all(isinstance(x, str) for x in arr):
        raise MalformedPayload("missing_hashes must be an array of strings", rule="store.missing_hashes")
    return arr


def parse_put_meta(payload: Buffer) -> int | None:
    """PUT_META request ``{"n_past":N}`` → N (None when absent/null). Empty → error."""
    if len(payload) == 0:
        raise MalformedPayload("empty payload", rule="store.put_meta_empty")
    n_past = parse_json_object(payload, "store.put_meta").get("n_past")
    if n_past is not None and not _is_int(n_past):
        raise MalformedPayload("n_past must be an int or null", rule="store.put_meta")
    return n_past
