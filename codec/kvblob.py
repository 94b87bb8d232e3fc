"""KV blob formats: payload of STATE_GET/PREFILL, input of STATE_PUT and of the DECODE kv segment.

docs/protocol.md §7. All integers little-endian::

    v1 (legacy)  [u32 n_past][u32 n_tok][i32 × n_tok]                                  state…
    v2 / v3      [u8 0x02|0x03][u32 n_past][u32 n_tok][i32 × n_tok][u8 flags][checkpoint?] state… [logits?]
    checkpoint   [i32 pos_min][i32 pos_max][i64 n_tokens][u64 tgt_sz][tgt][u64 dft_sz][dft]

flags bit0 = checkpoint present, bit1 (v3) = the checkpoint is a recurrent-only capture.
A first byte of 0x02/0x03 means v2/v3; anything else is legacy v1, so a v1 blob whose n_past
has low byte 2 or 3 is misdetected — an ambiguity of the format itself, reproduced here.

The state region is opaque and **not self-describing**: nothing in the blob says where it ends
when logits follow it. Who knows the split:

* the writer (STATE_GET never appends logits; PREFILL always does, ``logits_size`` = n_vocab×4
  and ``state_size`` are in its meta) → pass ``state_size=`` / ``has_logits=``;
* the C++ STATE_PUT loader, which loads the state, learns how many bytes it consumed, and takes
  the rest as logits iff it is exactly n_vocab×4 bytes → :func:`split_logits_tail` after loading.

Parsing never copies the state or logits; it returns offsets into the caller's buffer. Every
length claim is checked against the bytes that exist before anything is allocated.
"""
from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import dataclass
from typing import NamedTuple

from construct import (
    Array,
    Bytes,
    ConstructError,
    If,
    Int8ul,
    Int32sl,
    Int32ul,
    Int64sl,
    Int64ul,
    OneOf,
    Struct,
    Tell,
    this,
)

from .errors import LocalProtocolError, MalformedPayload, Truncated

KV_V2 = 0x02
KV_V3 = 0x03
FLAG_CHECKPOINT = 0x01
FLAG_RECURRENT_ONLY = 0x02  # v3 only
# M2-streaming builds start the state region with [4B io_magic][4B seq_id] (docs/protocol.md §7).
STATE_STREAM_PREFIX_LEN = 8

# ---- declarative layouts (source of truth; the inspector parses with these) -------------------

KV_V1_HEAD = Struct("n_past" / Int32ul, "n_tok" / Int32ul)
KV_V23_HEAD = Struct("version" / Int8ul, "n_past" / Int32ul, "n_tok" / Int32ul)
KV_CHECKPOINT_HEAD = Struct(
    "pos_min" / Int32sl, "pos_max" / Int32sl, "n_tokens" / Int64sl, "tgt_size" / Int64ul
)
KV_CHECKPOINT = Struct(
    "pos_min" / Int32sl,
    "pos_max" / Int32sl,
    "n_tokens" / Int64sl,
    "tgt_size" / Int64ul,
    "tgt" / Bytes(this.tgt_size),
    "dft_size" / Int64ul,
    "dft" / Bytes(this.dft_size),
)
KV_BLOB_HEADER_V1 = Struct(
    "n_past" / Int32ul, "n_tok" / Int32ul, "tokens" / Array(this.n_tok, Int32sl)
)
KV_BLOB_HEADER_V23 = Struct(
    "version" / OneOf(Int8ul, (KV_V2, KV_V3)),
    "n_past" / Int32ul,
    "n_tok" / Int32ul,
    "tokens" / Array(this.n_tok, Int32sl),
    "flags" / Int8ul,
    "checkpoint" / If(this.flags & FLAG_CHECKPOINT, KV_CHECKPOINT),
)

# ---- hot path: precompiled struct (tests prove it equals the construct path) ------------------

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_V1_HEAD = struct.Struct("<II")
_V23_HEAD = struct.Struct("<BII")
_CK_HEAD = struct.Struct("<iiqQ")
_U32_MAX = 0xFFFFFFFF

if array("i").itemsize != 4:  # pragma: no cover - every supported platform has 4-byte C int
    raise ImportError("codec.kvblob needs a 4-byte array('i')")
_BIG_ENDIAN = sys.byteorder == "big"

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class KvCheckpoint:
    pos_min: int
    pos_max: int
    n_tokens: int
    tgt: bytes = b""  # captures are small next to the state, so they are copied
    dft: bytes = b""


@dataclass(frozen=True, slots=True)
class KvBlobHeader:
    version: int  # 1 = legacy (no version byte), 2 or 3
    n_past: int
    tokens: tuple[int, ...]
    flags: int = 0  # always 0 for v1; unknown bits are kept as received
    checkpoint: KvCheckpoint | None = None

    @property
    def recurrent_only(self) -> bool:
        return bool(self.flags & FLAG_RECURRENT_ONLY)


class KvBlobLayout(NamedTuple):
    """Where things are in a parsed blob. Offsets index the buffer given to the parser."""

    header: KvBlobHeader
    state_offset: int  # == header length
    state_len: int
    logits_offset: int | None


def blob_version(first_byte: int) -> int:
    """1, 2 or 3 from the first byte of a blob (the C++ detection rule)."""
    return first_byte if first_byte in (KV_V2, KV_V3) else 1


def kv_header_need(prefix: Buffer, total_len: int | None = None) -> int:
    """How long the blob header is, as far as ``prefix`` (the first bytes of the blob) tells.

    For a server that streams a blob off the socket: returns ``n``; if ``n <= len(prefix)``
    the header is complete and exactly ``n`` bytes long, otherwise read until ``n`` bytes are
    buffered and ask again. ``total_len`` (default ``len(prefix)``) is the blob's full length;
    a header that claims more bytes than that raises Truncated with the rule naming the part
    ("kv.short", "kv.tokens", "kv.checkpoint") — before anything is read or allocated.
    """
    have = len(prefix)
    total = have if total_len is None else total_len
    if total < 1:
        raise Truncated("empty KV blob", rule="kv.short")
    if have < 1:
        return 1
    if blob_version(prefix[0]) == 1:
        if total < _V1_HEAD.size:
            raise Truncated(f"legacy KV blob of {total} bytes < 8", rule="kv.short")
        if have < _V1_HEAD.size:
            return _V1_HEAD.size
        n_tok = _U32.unpack_from(prefix, 4)[0]
        end = _V1_HEAD.size + 4 * n_tok
        if end > total:
            raise Truncated(f"{n_tok} tokens do not fit in {total} bytes", rule="kv.tokens")
        return end
    if total < _V23_HEAD.size:
        raise Truncated(f"v{prefix[0]} KV blob of {total} bytes < 9", rule="kv.short")
    if have < _V23_HEAD.size:
        return _V23_HEAD.size
    n_tok = _U32.unpack_from(prefix, 5)[0]
    flags_end = _V23_HEAD.size + 4 * n_tok + 1  # the flags byte travels with the token list
    if flags_end > total:
        raise Truncated(f"{n_tok} tokens + flags do not fit in {total} bytes", rule="kv.tokens")
    if have < flags_end:
        return flags_end
    if not prefix[flags_end - 1] & FLAG_CHECKPOINT:
        return flags_end
    ck_head_end = flags_end + _CK_HEAD.size
    if ck_head_end > total:
        raise Truncated("checkpoint header beyond the blob", rule="kv.checkpoint")
    if have < ck_head_end:
        return ck_head_end
    tgt_size = _U64.unpack_from(prefix, ck_head_end - 8)[0]
    dft_size_end = ck_head_end + tgt_size + 8
    if dft_size_end > total:
        raise Truncated(f"checkpoint tgt of {tgt_size} bytes beyond the blob", rule="kv.checkpoint")
    if have < dft_size_end:
        return dft_size_end
    dft_size = _U64.unpack_from(prefix, dft_size_end - 8)[0]
    end = dft_size_end + dft_size
    if end > total:
        raise Truncated(f"checkpoint dft of {dft_size} bytes beyond the blob", rule="kv.checkpoint")
    return end


def _tokens(buf: Buffer, offset: int, n_tok: int) -> tuple[int, ...]:
    arr = array("i")
    arr.frombytes(buf[offset : offset + 4 * n_tok])
    if _BIG_ENDIAN:  # pragma: no cover
        arr.byteswap()
    return tuple(arr)


def parse_kv_blob_header(buf: Buffer, *, total_len: int | None = None) -> tuple[KvBlobHeader, int]:
    """Parse the header at the start of ``buf``; returns ``(header, header_len)``.

    ``buf`` may be a prefix of a blob of ``total_len`` bytes (streaming); it must hold the whole
    header (see :func:`kv_header_need`), else Truncated("kv.incomplete").
    """
    end = kv_header_need(buf, total_len)
    if end > len(buf):
        raise Truncated(f"header needs {end} bytes, have {len(buf)}", rule="kv.incomplete")
    if blob_version(buf[0]) == 1:
        n_past, n_tok = _V1_HEAD.unpack_from(buf, 0)
        return KvBlobHeader(1, n_past, _tokens(buf, 8, n_tok)), end
    version, n_past, n_tok = _V23_HEAD.unpack_from(buf, 0)
    off = _V23_HEAD.size + 4 * n_tok
    flags = buf[off]
    off += 1
    checkpoint = None
    if flags & FLAG_CHECKPOINT:
        pos_min, pos_max, n_tokens, tgt_size = _CK_HEAD.unpack_from(buf, off)
        off += _CK_HEAD.size
        tgt = bytes(buf[off : off + tgt_size])
        off += tgt_size
        dft_size = _U64.unpack_from(buf, off)[0]
        off += 8
        dft = bytes(buf[off : off + dft_size])
        checkpoint = KvCheckpoint(pos_min, pos_max, n_tokens, tgt, dft)
    return KvBlobHeader(version, n_past, _tokens(buf, _V23_HEAD.size, n_tok), flags, checkpoint), end


def parse_kv_blob(
    buf: Buffer,
    *,
    n_vocab: int | None = None,
    has_logits: bool | None = None,
    state_size: int | None = None,
    min_state: int = 0,
) -> KvBlobLayout:
    """Parse a whole blob held in ``buf``; the state/logits regions are returned as offsets.

    Where the state ends (``rest`` = bytes after the header):

    * ``has_logits=False``: no logits, the state is ``rest``.
    * ``has_logits=True``: the last ``n_vocab*4`` bytes are logits (n_vocab required).
    * ``has_logits=None`` (auto): with ``state_size`` known (PREFILL/STATE_GET meta), ``rest``
      must be ``state_size`` (no logits) or ``state_size + n_vocab*4`` (logits), anything else
      is an error; without ``state_size`` the state is ``rest`` and no logits are assumed —
      the C++ STATE_PUT rule needs the loader's consumed count, see :func:`split_logits_tail`.

    ``min_state``: smallest acceptable state region (8 for M2 streams) → Truncated("kv.stream").
    """
    if n_vocab is not None and n_vocab <= 0 or has_logits and n_vocab is None:
        raise LocalProtocolError("n_vocab must be a positive int", rule="kv.n_vocab")
    header, header_len = parse_kv_blob_header(buf)
    rest = len(buf) - header_len
    logits = 4 * n_vocab if n_vocab is not None else None
    if state_size is not None and state_size < 0:
        raise LocalProtocolError("state_size must be >= 0", rule="kv.state_size")

    if has_logits is True:
        assert logits is not None
        if state_size is not None and rest != state_size + logits:
            raise _size_error(rest, state_size + logits, "state + logits")
        if rest < logits:
            raise Truncated(f"{rest} bytes after the header < {logits} bytes of logits", rule="kv.logits")
        state_len = rest - logits
    elif has_logits is False:
        if state_size is not None and rest != state_size:
            raise _size_error(rest, state_size, "state")
        state_len = rest
    elif state_size is not None:
        if rest == state_size:
            state_len = rest
        elif logits is not None and rest == state_size + logits:
            state_len = state_size
        else:
            raise _size_error(rest, state_size, "state (+ logits)")
    else:
        state_len = rest

    if state_len < min_state:
        raise Truncated(f"state region of {state_len} bytes < {min_state}", rule="kv.stream")
    logits_offset = header_len + state_len if state_len != rest else None
    return KvBlobLayout(header, header_len, state_len, logits_offset)


def _size_error(rest: int, want: int, what: str) -> MalformedPayload | Truncated:
    if rest < want:
        return Truncated(f"{rest} bytes after the header < {want} bytes of {what}", rule="kv.state_size")
    return MalformedPayload(f"{rest} bytes after the header != {want} bytes of {what}", rule="kv.trailing")


def is_logits_tail(leftover: int, n_vocab: int) -> bool:
    """The C++ STATE_PUT rule: the bytes left after the consumed state are logits if and only if
    they are exactly ``n_vocab`` float32."""
    return n_vocab > 0 and leftover == 4 * n_vocab


def split_logits_tail(layout: KvBlobLayout, consumed: int, n_vocab: int) -> KvBlobLayout:
    """The C++ STATE_PUT rule, applied once the state loader reports ``consumed`` bytes.

    If the bytes left after the consumed state are exactly ``n_vocab*4`` they are logits;
    any other leftover is ignored (the C++ only looks for that exact size).
    """
    if not 0 <= consumed <= layout.state_len:
        raise LocalProtocolError(f"consumed {consumed} outside the state region", rule="kv.consumed")
    if is_logits_tail(layout.state_len - consumed, n_vocab):
        return layout._replace(state_len=consumed, logits_offset=layout.state_offset + consumed)
    return layout


def max_kv_blob_size(n_tokens: int, max_state: int, n_vocab: int) -> int:
    """The largest blob a sequence of up to ``n_tokens`` can need: a v2/v3 header listing every
    token, a checkpoint whose captures total at most ``max_state`` bytes, a state of at most
    ``max_state`` bytes, and the n_vocab × 4 bytes of a logits tail. A receiver caps a blob's
    length by it before allocating anything."""
    head = _V23_HEAD.size + 4 * n_tokens + 1 + _CK_HEAD.size + _U64.size
    return head + 2 * max_state + 4 * n_vocab


# ---- encoder -------------------------------------------------------------------------------


def encode_kv_blob_header(
    version: int,
    n_past: int,
    tokens: list[int] | tuple[int, ...] | array,
    checkpoint: KvCheckpoint | None = None,
    *,
    recurrent_only: bool = False,
    flags: int | None = None,
) -> bytes:
    """The header bytes of a v1/v2/v3 blob; append the state (and logits) to complete it.

    ``flags`` defaults to what ``checkpoint``/``recurrent_only`` imply; an explicit value may
    carry extra bits (for fuzzing) but bit0 must agree with ``checkpoint``.
    """
    if version not in (1, KV_V2, KV_V3):
        raise LocalProtocolError(f"KV blob version {version!r} is not 1, 2 or 3", rule="kv.version")
    if not 0 <= n_past <= _U32_MAX:
        raise LocalProtocolError(f"n_past {n_past} is not a u32", rule="kv.n_past")
    try:
        arr = tokens if isinstance(tokens, array) and tokens.typecode == "i" else array("i", tokens)
    except (OverflowError, TypeError) as e:
        raise LocalProtocolError(f"tokens must be i32: {e}", rule="kv.tokens") from None
    if len(arr) > _U32_MAX:
        raise LocalProtocolError("more than 2**32-1 tokens", rule="kv.tokens")
    if _BIG_ENDIAN:  # pragma: no cover
        arr = array("i", arr)
        arr.byteswap()
    token_bytes = arr.tobytes()
    if version == 1:
        if checkpoint is not None or recurrent_only or flags:
            raise LocalProtocolError("legacy v1 blobs have no flags or checkpoint", rule="kv.v1_flags")
        return _V1_HEAD.pack(n_past, len(arr)) + token_bytes
    if recurrent_only and version != KV_V3:
        raise LocalProtocolError("the recurrent-only flag exists only in v3", rule="kv.flags")
    if flags is None:
        flags = (FLAG_CHECKPOINT if checkpoint is not None else 0) | (FLAG_RECURRENT_ONLY if recurrent_only else 0)
    if not 0 <= flags <= 0xFF or bool(flags & FLAG_CHECKPOINT) != (checkpoint is not None):
        raise LocalProtocolError(f"flags 0x{flags:x} disagree with the checkpoint", rule="kv.flags")
    parts = [_V23_HEAD.pack(version, n_past, len(arr)), token_bytes, bytes((flags,))]
    if checkpoint is not None:
        try:
            parts.append(_CK_HEAD.pack(checkpoint.pos_min, checkpoint.pos_max, checkpoint.n_tokens, len(checkpoint.tgt)))
        except struct.error as e:
            raise LocalProtocolError(f"checkpoint field out of range: {e}", rule="kv.checkpoint") from None
        parts += [checkpoint.tgt, _U64.pack(len(checkpoint.dft)), checkpoint.dft]
    return b"".join(parts)


# ---- the construct path (slow; for the inspector and the differential tests) ----------------


def parse_kv_blob_header_construct(buf: Buffer) -> tuple[KvBlobHeader, int]:
    """Same contract as :func:`parse_kv_blob_header` (whole buffer), computed with construct."""
    if len(buf) < 1:
        raise Truncated("empty KV blob", rule="kv.short")
    v1 = blob_version(buf[0]) == 1
    layout = Struct("h" / (KV_BLOB_HEADER_V1 if v1 else KV_BLOB_HEADER_V23), "end" / Tell)
    try:
        parsed = layout.parse(bytes(buf))
    except ConstructError as e:
        raise Truncated(f"KV blob header: {e}", rule="kv.construct") from None
    c, end = parsed.h, parsed.end
    if v1:
        return KvBlobHeader(1, c.n_past, tuple(c.tokens)), end
    ck = c.checkpoint
    checkpoint = None if ck is None else KvCheckpoint(ck.pos_min, ck.pos_max, ck.n_tokens, ck.tgt, ck.dft)
    return KvBlobHeader(c.version, c.n_past, tuple(c.tokens), c.flags, checkpoint), end
