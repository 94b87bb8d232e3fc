"""llama.cpp's sequence state file header (slot files): the struct path equals the construct
layout, and every claim in a header is checked before anything is sized by it."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from codec.errors import CodecError, MalformedPayload, Truncated
from codec.slotfile import (
    HEAD_SIZE,
    SLOT_FILE_HEAD,
    SLOT_FILE_MAGIC,
    SLOT_FILE_VERSION,
    encode_slot_file_head,
    parse_slot_file_head,
    parse_tokens,
)

tokens_st = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=64)


@given(tokens_st)
def test_encoder_matches_the_construct_layout(tokens):
    head = encode_slot_file_head(tokens)
    parsed = SLOT_FILE_HEAD.parse(head)
    assert parsed.n_token_count == len(tokens) and list(parsed.tokens) == tokens
    assert SLOT_FILE_HEAD.build({"n_token_count": len(tokens), "tokens": tokens}) == head
    n = parse_slot_file_head(head[:HEAD_SIZE], len(head) + 10, max_tokens=64)
    assert n == len(tokens) and parse_tokens(head[HEAD_SIZE:], n) == tokens


@given(st.binary(max_size=32), st.integers(0, 1 << 40), st.integers(0, 1 << 20))
def test_any_header_bytes_parse_or_raise_a_codec_error(raw, size, max_tokens):
    try:
        n = parse_slot_file_head(raw, size, max_tokens)
    except CodecError:
        return
    assert n <= max_tokens and HEAD_SIZE + 4 * n <= size


def test_claims_are_checked():
    head = struct.pack("<III", SLOT_FILE_MAGIC, SLOT_FILE_VERSION, 1000)
    with pytest.raises(MalformedPayload, match="more than the slot context"):
        parse_slot_file_head(head, 1 << 30, max_tokens=999)
    with pytest.raises(Truncated, match="claims 1000 tokens"):
        parse_slot_file_head(head, HEAD_SIZE + 3999, max_tokens=1000)
    with pytest.raises(MalformedPayload, match="version 2"):
        parse_slot_file_head(struct.pack("<III", SLOT_FILE_MAGIC, 2, 0), 12, 10)
    with pytest.raises(MalformedPayload, match="magic"):
        parse_slot_file_head(b"GGUF" + bytes(8), 12, 10)
    with pytest.raises(Truncated):
        parse_slot_file_head(b"\x71\x73", 2, 10)


def test_a_slot_file_cut_while_being_read_is_refused_not_restored_with_zeros(tmp_path, monkeypatch):
    """The state's length comes from the file's size when it was opened; a file cut after that
    reads short, and a state whose tail was never read must not reach llama.cpp as zeros."""
    import os

    from engine import slot_files

    path = tmp_path / "a.bin"
    state_bytes = b"s" * (1 << 20)  # past what a buffered read takes ahead, and a mapping (lazy_buffer)
    slot_files._write(path, [1, 2, 3], memoryview(state_bytes))
    tokens, state, size = slot_files._read(path, 100)
    assert tokens == [1, 2, 3] and bytes(state) == state_bytes and size == path.stat().st_size

    parse = slot_files.parse_slot_file_head

    def cut_after_the_head(head, size, max_tokens):  # the size already taken: the file loses 16 bytes
        os.truncate(path, size - 16)
        return parse(head, size, max_tokens)

    monkeypatch.setattr(slot_files, "parse_slot_file_head", cut_after_the_head)
    with pytest.raises(CodecError, match="cut short"):
        slot_files._read(path, 100)
