"""llama.cpp's sequence state file: what llama-server's ``POST /slots/{id}?action=save`` writes.

``llama_state_seq_save_file`` / ``llama_state_seq_load_file`` (docs/http.md, slot files). All
integers little-endian::

    u32 magic = 0x67677371 ('ggsq') | u32 version = 3 | u32 n_token_count
    i32 × n_token_count tokens                             (the slot's prompt)
    state…                                                 (what llama_state_seq_get_data writes)

A file saved by llama-server loads here and the other way round. ``n_token_count`` is a
claim: it is checked against the bytes that exist and the caller's limit before anything
is sized by it.
"""
from __future__ import annotations

import struct
import sys
from array import array

from construct import Array, Const, Int32sl, Int32ul, Struct, this

from .errors import LocalProtocolError, MalformedPayload, Truncated

SLOT_FILE_MAGIC = 0x67677371  # LLAMA_STATE_SEQ_MAGIC ('ggsq')
SLOT_FILE_VERSION = 3  # LLAMA_STATE_SEQ_VERSION of the vendored llama.cpp

SLOT_FILE_HEAD = Struct(
    "magic" / Const(SLOT_FILE_MAGIC, Int32ul),
    "version" / Const(SLOT_FILE_VERSION, Int32ul),
    "n_token_count" / Int32ul,
    "tokens" / Array(this.n_token_count, Int32sl),
)

_HEAD = struct.Struct("<III")
HEAD_SIZE = _HEAD.size
_BIG_ENDIAN = sys.byteorder == "big"

Buffer = bytes | bytearray | memoryview


def encode_slot_file_head(tokens: list[int] | tuple[int, ...]) -> bytes:
    """The header and tokens; the state bytes follow them in the file."""
    try:
        arr = array("i", tokens)
    except (OverflowError, TypeError) as e:
        raise LocalProtocolError(f"tokens must be i32: {e}", rule="slotfile.tokens") from None
    if _BIG_ENDIAN:  # pragma: no cover
        arr.byteswap()
    return _HEAD.pack(SLOT_FILE_MAGIC, SLOT_FILE_VERSION, len(arr)) + arr.tobytes()


def parse_slot_file_head(head: Buffer, file_size: int, max_tokens: int) -> int:
    """Check the 12-byte header of a file of ``file_size`` bytes; returns ``n_token_count``.

    Raises MalformedPayload (not a slot file, another version, more tokens than
    ``max_tokens``) or Truncated (the tokens claimed are not in the file).
    """
    if len(head) < HEAD_SIZE:
        raise Truncated(f"a slot file starts with {HEAD_SIZE} header bytes, this one has {len(head)}",
                        rule="slotfile.short")
    magic, version, n_tok = _HEAD.unpack_from(head, 0)
    if magic != SLOT_FILE_MAGIC:
        raise MalformedPayload(f"not a llama.cpp sequence state file (magic 0x{magic:08x})", rule="slotfile.magic")
    if version != SLOT_FILE_VERSION:
        raise MalformedPayload(f"sequence state file version {version}, this engine reads {SLOT_FILE_VERSION}",
                               rule="slotfile.version")
    if n_tok > max_tokens:
        raise MalformedPayload(f"the file holds {n_tok} tokens, more than the slot context of {max_tokens}",
                               rule="slotfile.n_tokens")
    if HEAD_SIZE + 4 * n_tok > file_size:
        raise Truncated(f"the file claims {n_tok} tokens but has {file_size} bytes", rule="slotfile.truncated")
    return n_tok


def parse_tokens(buf: Buffer, n_tok: int) -> list[int]:
    """The ``n_tok`` tokens at the start of ``buf`` (the bytes after the header)."""
    arr = array("i")
    arr.frombytes(bytes(buf[:4 * n_tok]))
    if _BIG_ENDIAN:  # pragma: no cover
        arr.byteswap()
    return arr.tolist()
