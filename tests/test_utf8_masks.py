"""Grammars keep generated text valid UTF-8 (engine/utf8.py): llama.cpp's grammar
reads a character's length from its lead byte alone, so these masks refuse what it would take."""
from __future__ import annotations

import itertools

from engine.utf8 import owed_after, unfinished, utf8_masks, valid_prefix

PIECES = [b"a", b"\xe6", b"\x94", b"\xb7", b"\xfc", b"\xe6\x94", b"\xc2\xbe", b"\xf4\xb3", b"\xc0", b"\xb7a"]


def test_masks_by_bytes_owed():
    m = utf8_masks(PIECES)
    # at a character boundary: ASCII, leads and whole characters; never a continuation byte,
    # a byte that is never UTF-8 (0xFC, 0xC0) or an impossible sequence (F4 B3 is above U+10FFFF)
    assert [p for p, ok in zip(PIECES, m[0]) if ok] == [b"a", b"\xe6", b"\xe6\x94", b"\xc2\xbe"]
    # mid-character: continuation bytes, and what follows them only once the character is whole
    assert [p for p, ok in zip(PIECES, m[1]) if ok] == [b"\x94", b"\xb7", b"\xb7a"]
    for k in (2, 3):
        assert [p for p, ok in zip(PIECES, m[k]) if ok] == [b"\x94", b"\xb7"]


def test_owed_and_unfinished_follow_the_last_character():
    assert [owed_after(t) for t in (b"", b"a", b"\xe6", b"\xe6\x94", b"\xe6\x94\xb7", b"\xf0", b"x\xf0\x9f")] == \
        [0, 0, 2, 1, 0, 3, 2]
    assert unfinished(b"\x94\xb7\xe6\x94") == b"\xe6\x94" and unfinished(b"abc") == b""


def test_a_walk_that_follows_the_masks_is_valid_utf8():
    """Every sequence of pieces the masks allow, checked exactly where a character is split,
    decodes strictly (what the grammar sampler does at each step)."""
    m = utf8_masks(PIECES)
    for seq in itertools.product(range(len(PIECES)), repeat=3):
        text = b""
        for t in seq:
            owed = owed_after(text[-4:])
            if not m[owed, t] or (owed and not valid_prefix(unfinished(text[-4:]) + PIECES[t])):
                break
            text += PIECES[t]
        else:
            if owed_after(text[-4:]) == 0:
                text.decode("utf-8")  # strict: raises if a mask let an invalid byte through
            assert valid_prefix(text)
