"""llama.cpp's sequence state: the state region of STATE_GET/PUT and of the DECODE kv segment.

It is exactly what ``llama_state_seq_get_data`` writes (llama.cpp since b9049, and the
llama.cpp vendored in llama-cpp-python 0.3.36). All integers little-endian::

    u32 magic = 0xaf143cd8 | i32 seq_id                    (the writer's slot; readers ignore it)
    per KV cache (1; 2 for iSWA models: the full cache, then the sliding-window one):
      u32 n_stream                                          (1 if kv_unified, else n_seq_max)
      per stream: u32 cell_count; if cell_count > 0:
        cell_count × {i32 pos, u32 n_seq_id (=1), [ext: i32 x, i32 y, i32 tok], i32 seq_id}
        u32 v_trans (1 = V transposed = flash attention off), u32 n_layer
        n_layer × {i32 k_type, u64 k_row_size, cell_count × k_row_size bytes}
        v_trans 0: n_layer × {i32 v_type, u64 v_row_size, cell_count × v_row_size bytes}
        v_trans 1: n_layer × {i32 v_type, u32 v_el_size, u32 n_embd_v_gqa,
                               n_embd_v_gqa × cell_count × v_el_size bytes}

Nothing in the bytes says whether cells carry the 12-byte ``ext`` (M-RoPE and per-layer
embedding models) or how many KV caches follow: the reader's model knows, so the caller
says (``cell_ext``, ``n_caches``). Recurrent and hybrid memory layouts are not parsed.

:func:`parse_seq_state` reads only the headers: it never copies tensor data, and every
count, size and position in the blob is a claim checked against the bytes that exist and
against the caller's limits (slot context, layers) before anything is sized by it. The work
is O(cells + layers), in numpy for the per-cell records. :func:`compare` then names the
first field that differs from what this engine's context would accept — llama.cpp itself
only logs such a mismatch and returns 0.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from construct import Array, Bytes, Const, If, Int32sl, Int32ul, Int64ul, Struct, Switch, this

from .errors import LocalProtocolError, MalformedPayload, Truncated

SEQ_STATE_MAGIC = 0xAF143CD8
MAX_STREAMS = 256  # LLAMA_MAX_SEQ: a context has at most this many sequences, hence streams
CELL_EXT_SIZE = 12

#: ggml_type ids → ggml_type_name (ggml.h / ggml.c of the vendored llama.cpp).
GGML_TYPE_NAMES = {
    0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 9: "q8_1",
    10: "q2_K", 11: "q3_K", 12: "q4_K", 13: "q5_K", 14: "q6_K", 15: "q8_K", 16: "iq2_xxs",
    17: "iq2_xs", 18: "iq3_xxs", 19: "iq1_s", 20: "iq4_nl", 21: "iq3_s", 22: "iq2_s", 23: "iq4_xs",
    24: "i8", 25: "i16", 26: "i32", 27: "i64", 28: "f64", 29: "iq1_m", 30: "bf16", 34: "tq1_0",
    35: "tq2_0", 39: "mxfp4", 40: "nvfp4", 41: "q1_0", 42: "q2_0",
}
GGML_TYPE_IDS = {name: tid for tid, name in GGML_TYPE_NAMES.items()}
#: (elements per block, bytes per block) of the types a KV cache may have (llama.cpp's
#: ``kv_cache_types``), for ggml_row_size / ggml_type_size.
KV_TYPE_BLOCKS = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
    "q4_1": (32, 20), "iq4_nl": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24),
}

Buffer = bytes | bytearray | memoryview


def ggml_type_name(type_id: int) -> str:
    return GGML_TYPE_NAMES.get(type_id, f"ggml_type({type_id})")


def kv_row_size(type_name: str, n: int) -> int:
    """ggml_row_size(type, n) for a KV cache type."""
    try:
        blck, size = KV_TYPE_BLOCKS[type_name]
    except KeyError:
        raise LocalProtocolError(f"{type_name!r} is not a KV cache type", rule="seq.kv_type") from None
    if n % blck:
        raise LocalProtocolError(f"{n} elements are not whole {type_name} blocks of {blck}", rule="seq.kv_type")
    return n // blck * size


# ---- declarative layout (source of truth for one KV cache without cell ext) ------------------

SEQ_STATE_PREFIX = Struct("magic" / Const(SEQ_STATE_MAGIC, Int32ul), "seq_id" / Int32sl)
_CELL = Struct("pos" / Int32sl, "n_seq_id" / Int32ul, "seq_ids" / Array(this.n_seq_id, Int32sl))
_K_LAYER = Struct("type" / Int32sl, "row_size" / Int64ul, "data" / Bytes(this.row_size * this._._.cell_count))
_V_ROWS = Struct("type" / Int32sl, "row_size" / Int64ul, "data" / Bytes(this.row_size * this._._.cell_count))
_V_TRANS = Struct(
    "type" / Int32sl, "el_size" / Int32ul, "n_embd" / Int32ul,
    "data" / Bytes(this.el_size * this.n_embd * this._._.cell_count),
)
_STREAM = Struct(
    "cell_count" / Int32ul,
    "body" / If(this.cell_count > 0, Struct(
        "cells" / Array(this._.cell_count, _CELL),
        "v_trans" / Int32ul,
        "n_layer" / Int32ul,
        "k" / Array(this.n_layer, _K_LAYER),
        "v" / Array(this.n_layer, Switch(this.v_trans, {0: _V_ROWS}, default=_V_TRANS)),
    )),
)
KV_CACHE_STATE = Struct("n_stream" / Int32ul, "streams" / Array(this.n_stream, _STREAM))
SEQ_STATE = Struct("prefix" / SEQ_STATE_PREFIX, "kv" / KV_CACHE_STATE)


# ---- summary -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LayerTypes:
    """One layer's K and V as the blob describes them (V: row size, or element size ×
    n_embd when transposed)."""

    k_type: int
    k_row_size: int
    v_type: int
    v_row_size: int  # v_trans 0: bytes per cell; v_trans 1: v_el_size
    v_n_embd: int | None = None  # v_trans 1 only


@dataclass(frozen=True, slots=True)
class StreamSummary:
    cell_count: int
    pos_min: int | None = None
    pos_max: int | None = None
    v_trans: int | None = None
    layers: tuple[LayerTypes, ...] = ()


@dataclass(frozen=True, slots=True)
class KvCacheSummary:
    n_stream: int
    streams: tuple[StreamSummary, ...]

    @property
    def filled(self) -> tuple[StreamSummary, ...]:
        return tuple(s for s in self.streams if s.cell_count)


@dataclass(frozen=True, slots=True)
class SeqStateSummary:
    seq_id: int
    caches: tuple[KvCacheSummary, ...]
    size: int  # bytes the state occupies from the start of the buffer (what a reader consumes)

    @property
    def n_stream(self) -> int:
        return self.caches[0].n_stream

    @property
    def cell_count(self) -> int:
        return sum(s.cell_count for s in self.caches[0].streams)

    def _filled(self) -> list[StreamSummary]:
        return [s for c in self.caches for s in c.filled]

    @property
    def pos_min(self) -> int | None:
        return min((s.pos_min for s in self._filled()), default=None)

    @property
    def pos_max(self) -> int | None:
        return max((s.pos_max for s in self._filled()), default=None)

    @property
    def v_trans(self) -> int | None:
        return next((s.v_trans for s in self._filled()), None)

    @property
    def n_layer(self) -> int | None:
        return next((len(s.layers) for s in self._filled()), None)

    def as_dict(self) -> dict:
        """JSON-able form with type names (for STATE_META / INFO / errors)."""
        layers = next((s.layers for s in self._filled()), ())
        return {
            "seq_id": self.seq_id, "n_stream": self.n_stream, "cell_count": self.cell_count,
            "pos_min": self.pos_min, "pos_max": self.pos_max, "v_trans": self.v_trans, "n_layer": self.n_layer,
            "type_k": sorted({ggml_type_name(ly.k_type) for ly in layers}),
            "type_v": sorted({ggml_type_name(ly.v_type) for ly in layers}),
            "size": self.size,
        }


# ---- the parser ----------------------------------------------------------------------------

_U32 = struct.Struct("<I")
_TWO_U32 = struct.Struct("<II")
_PREFIX = struct.Struct("<Ii")
_K_HEAD = struct.Struct("<iQ")
_VT_HEAD = struct.Struct("<iII")


@dataclass(frozen=True, slots=True)
class SeqField:
    """Where one header field of a sequence state is (for tools that edit blobs in place)."""

    name: str  # e.g. "n_stream", "cell_count", "cell 3 pos", "layer 0 K row_size"
    offset: int
    fmt: str  # its struct format, little-endian: "<I", "<i" or "<Q"


class _Reader:
    """Bounds-checked cursor; every length is checked against what is left first. With
    ``fields`` it records where each header field it reads is."""

    __slots__ = ("buf", "off", "end", "fields")

    def __init__(self, buf: Buffer, fields: list[SeqField] | None = None) -> None:
        self.buf, self.off, self.end, self.fields = buf, 0, len(buf), fields

    def left(self) -> int:
        return self.end - self.off

    def need(self, n: int, what: str) -> None:
        if n > self.left():
            raise Truncated(f"{what} needs {n} bytes at offset {self.off}, {self.left()} left", rule="seq.truncated")

    def unpack(self, st: struct.Struct, what: str, names: tuple[str, ...] = ()) -> tuple:
        self.need(st.size, what)
        if self.fields is not None:
            self.record(st.format[1:], names or (what,), self.off)
        v = st.unpack_from(self.buf, self.off)
        self.off += st.size
        return v

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.off += n

    def record(self, codes: str, names: tuple[str, ...], off: int) -> None:
        for code, name in zip(codes, names, strict=True):
            self.fields.append(SeqField(name, off, "<" + code))
            off += struct.calcsize("<" + code)


def parse_seq_state(
    buf: Buffer,
    *,
    max_cells: int,
    max_layers: int = 1024,
    max_pos: int | None = None,
    max_streams: int = MAX_STREAMS,
    cell_ext: bool = False,
    n_caches: int = 1,
    fields: list[SeqField] | None = None,
) -> SeqStateSummary:
    """Summarise the sequence state at the start of ``buf`` (it may be followed by logits).

    Limits, checked before a claim sizes anything: ``max_cells`` cells per stream (the slot
    context), ``max_layers``, ``max_streams``, and positions in ``[0, max_pos)`` (default
    ``max_cells``). Raises :class:`Truncated` / :class:`MalformedPayload` (rule ``seq.*``).
    ``fields``, when given, receives where each header field read so far is.
    """
    if max_cells < 0 or max_layers < 0 or n_caches < 1:
        raise LocalProtocolError("limits must be >= 0 and n_caches >= 1", rule="seq.limits")
    r = _Reader(memoryview(buf).cast("B") if not isinstance(buf, bytes) else buf, fields)
    magic, seq_id = r.unpack(_PREFIX, "the magic and seq_id", ("magic", "seq_id"))
    if magic != SEQ_STATE_MAGIC:
        raise MalformedPayload(
            f"KV state lacks llama.cpp's sequence-state magic 0x{SEQ_STATE_MAGIC:08x} (got 0x{magic:08x}): "
            "a pre-b9049 writer or a misparsed header", rule="seq.magic")
    limit_pos = max_cells if max_pos is None else max_pos
    caches = tuple(_parse_cache(r, max_cells, max_layers, limit_pos, max_streams, cell_ext) for _ in range(n_caches))
    return SeqStateSummary(seq_id, caches, r.off)


def _parse_cache(r: _Reader, max_cells: int, max_layers: int, max_pos: int, max_streams: int,
                 cell_ext: bool) -> KvCacheSummary:
    (n_stream,) = r.unpack(_U32, "n_stream")
    if not 1 <= n_stream <= max_streams:
        raise MalformedPayload(f"n_stream {n_stream} outside 1..{max_streams}", rule="seq.n_stream")
    # each stream takes at least its 4-byte cell count: a claim the bytes must back
    r.need(4 * n_stream, f"{n_stream} streams")
    streams = tuple(_parse_stream(r, max_cells, max_layers, max_pos, cell_ext) for _ in range(n_stream))
    return KvCacheSummary(n_stream, streams)


def _parse_stream(r: _Reader, max_cells: int, max_layers: int, max_pos: int, cell_ext: bool) -> StreamSummary:
    (cells,) = r.unpack(_U32, "cell_count")
    if cells == 0:
        return StreamSummary(0)
    if cells > max_cells:
        raise MalformedPayload(f"{cells} cells > {max_cells}, the slot context", rule="seq.cells")
    words = 6 if cell_ext else 3  # pos, n_seq_id, [x, y, tok,] seq_id
    r.need(4 * words * cells, f"{cells} cell records")
    if r.fields is not None:
        names = ("pos", "n_seq_id", "x", "y", "tok", "seq_id") if cell_ext else ("pos", "n_seq_id", "seq_id")
        for i in range(cells):
            r.record("iIiiii" if cell_ext else "iIi", tuple(f"cell {i} {n}" for n in names), r.off + 4 * words * i)
    recs = np.frombuffer(r.buf, dtype="<i4", count=words * cells, offset=r.off).reshape(cells, words)
    r.off += 4 * words * cells
    if (recs[:, 1] != 1).any():
        i = int(np.argmax(recs[:, 1] != 1))
        raise MalformedPayload(f"cell {i} has {int(recs[i, 1]) & 0xFFFFFFFF} seq ids, a sequence state has 1",
                               rule="seq.n_seq_id")
    pos = recs[:, 0]
    pos_min, pos_max = int(pos.min()), int(pos.max())
    if pos_min < 0 or pos_max >= max_pos:
        raise MalformedPayload(f"positions {pos_min}..{pos_max} outside 0..{max_pos - 1}", rule="seq.pos")
    v_trans, n_layer = r.unpack(_TWO_U32, "v_trans and n_layer", ("v_trans", "n_layer"))
    if v_trans > 1:
        raise MalformedPayload(f"v_trans {v_trans} is not 0 or 1", rule="seq.v_trans")
    if n_layer > max_layers:
        raise MalformedPayload(f"{n_layer} layers > {max_layers}", rule="seq.n_layer")
    k = []
    for il in range(n_layer):
        k_type, row = r.unpack(_K_HEAD, f"layer {il} K header", (f"layer {il} K type", f"layer {il} K row_size"))
        _check_rows(r, row, cells, f"layer {il} K")
        r.skip(row * cells, f"layer {il} K data")
        k.append((k_type, row))
    layers = []
    for il in range(n_layer):
        if v_trans:
            v_type, el, n_embd = r.unpack(_VT_HEAD, f"layer {il} V header",
                                          (f"layer {il} V type", f"layer {il} V el_size", f"layer {il} V n_embd"))
            _check_rows(r, el * n_embd, cells, f"layer {il} V")
            r.skip(el * n_embd * cells, f"layer {il} V data")
            layers.append(LayerTypes(k[il][0], k[il][1], v_type, el, n_embd))
        else:
            v_type, row = r.unpack(_K_HEAD, f"layer {il} V header", (f"layer {il} V type", f"layer {il} V row_size"))
            _check_rows(r, row, cells, f"layer {il} V")
            r.skip(row * cells, f"layer {il} V data")
            layers.append(LayerTypes(k[il][0], k[il][1], v_type, row))
    return StreamSummary(cells, pos_min, pos_max, v_trans, tuple(layers))


def _check_rows(r: _Reader, row: int, cells: int, what: str) -> None:
    if row == 0:
        raise MalformedPayload(f"{what} row size is 0", rule="seq.row_size")
    if row > r.left() // cells:  # row × cells would not fit: refuse without multiplying a claim
        raise Truncated(f"{what}: {cells} rows of {row} bytes beyond the blob", rule="seq.truncated")


# ---- what this engine accepts ----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class KvExpected:
    """The KV layout of this engine's context, as a restore needs it.

    ``n_embd_k`` / ``n_embd_v``: per layer, n_embd_k_gqa / n_embd_v_gqa (head dim × KV heads).
    ``v_trans`` is ``not flash_attn``; ``n_stream`` is 1 with kv_unified, else n_seq_max.
    """

    n_stream: int
    v_trans: bool
    type_k: str
    type_v: str
    n_embd_k: tuple[int, ...]
    n_embd_v: tuple[int, ...]
    max_cells: int

    def layers(self) -> list[LayerTypes]:
        tk, tv = GGML_TYPE_IDS[self.type_k], GGML_TYPE_IDS[self.type_v]
        out = []
        for nk, nv in zip(self.n_embd_k, self.n_embd_v, strict=True):
            if self.v_trans:
                out.append(LayerTypes(tk, kv_row_size(self.type_k, nk), tv, KV_TYPE_BLOCKS[self.type_v][1], nv))
            else:
                out.append(LayerTypes(tk, kv_row_size(self.type_k, nk), tv, kv_row_size(self.type_v, nv)))
        return out


Mismatch = tuple[str, object, object]


def compare(summary: SeqStateSummary, expected: KvExpected) -> Mismatch | None:
    """The first field where the blob differs from what ``expected`` accepts, as
    ``(field, got, want)`` with ggml type names, in the order llama.cpp checks; or None.

    Fields: n_stream, cell_count, n_layer, v_trans, type_k, k_row_size, type_v,
    v_row_size / v_el_size / n_embd_v (the last two for transposed V).
    """
    for cache in summary.caches:
        if cache.n_stream != expected.n_stream:
            return ("n_stream", cache.n_stream, expected.n_stream)
        want_layers = expected.layers()
        for s in cache.filled:
            if s.cell_count > expected.max_cells:
                return ("cell_count", s.cell_count, expected.max_cells)
            if len(s.layers) != len(want_layers):
                return ("n_layer", len(s.layers), len(want_layers))
            if s.v_trans != int(expected.v_trans):
                return ("v_trans", s.v_trans, int(expected.v_trans))
            for got, want in zip(s.layers, want_layers):
                m = _layer_mismatch(got, want)
                if m:
                    return m
    return None


def _layer_mismatch(got: LayerTypes, want: LayerTypes) -> Mismatch | None:
    if got.k_type != want.k_type:
        return ("type_k", ggml_type_name(got.k_type), ggml_type_name(want.k_type))
    if got.k_row_size != want.k_row_size:
        return ("k_row_size", got.k_row_size, want.k_row_size)
    if got.v_type != want.v_type:
        return ("type_v", ggml_type_name(got.v_type), ggml_type_name(want.v_type))
    if got.v_row_size != want.v_row_size:
        return ("v_el_size" if want.v_n_embd is not None else "v_row_size", got.v_row_size, want.v_row_size)
    if got.v_n_embd != want.v_n_embd:
        return ("n_embd_v", got.v_n_embd, want.v_n_embd)
    return None
