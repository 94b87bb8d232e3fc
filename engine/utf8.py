"""Which tokens keep generated text valid UTF-8, by how many continuation bytes are owed.

llama.cpp's grammar reads a character's length from its lead byte and takes whatever bytes
follow, so a grammar alone lets a model write invalid UTF-8 — which the client then sees as
several U+FFFD characters where the grammar counted one. Grammars therefore also refuse the
tokens these masks rule out. Pure Python and numpy: a token's bytes in, masks out.
"""
from __future__ import annotations

import codecs
from typing import Sequence

import numpy as np

# a lead byte that owes k continuation bytes and takes any of 0x80..0xBF after it; some leads
# take fewer (0xE0, 0xED, 0xF0, 0xF4), so mid-character rows are a superset, refined against
# the real text by the sampler
_LEADS = (b"", b"\xc2", b"\xe1", b"\xf1")


def valid_prefix(data: bytes) -> bool:
    """``data`` can begin valid UTF-8 text (it may end inside a character)."""
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(data, final=False)
    except UnicodeDecodeError:
        return False
    return True


def utf8_masks(pieces: Sequence[bytes]) -> np.ndarray:
    """bool[4, len(pieces)]: ``[k, t]`` is True when text owing ``k`` continuation bytes stays a
    valid UTF-8 prefix with token ``t``'s bytes appended."""
    out = np.zeros((4, len(pieces)), dtype=bool)
    for t, piece in enumerate(pieces):
        if piece.isascii():  # most tokens: fine at a character boundary, never mid-character
            out[0, t] = True
            continue
        for k, lead in enumerate(_LEADS):
            out[k, t] = valid_prefix(lead + piece)
    return out


def unfinished(tail: bytes) -> bytes:
    """The bytes of the character ``tail`` ends inside (from its lead byte); b"" at a boundary."""
    owed = owed_after(tail)
    if owed == 0:
        return b""
    for back in range(1, min(4, len(tail)) + 1):
        if tail[-back] >= 0xC0:
            return tail[-back:]
    return b""


def owed_after(tail: bytes) -> int:
    """Continuation bytes still owed after ``tail`` (the last few bytes of valid text)."""
    for back in range(1, min(4, len(tail)) + 1):
        b = tail[-back]
        if b < 0x80:
            return 0
        if b >= 0xC0:  # the lead of the last character: it needs this many bytes in all
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return max(0, need - back)
    return 0
