"""codec.frames.split_frames: the whole requests in a byte string, and what follows them."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from codec.enums import Op
from codec.frames import split_frames
from codec.framing import REQUEST_HEADER_SIZE, encode_request, pack_request_header_unchecked

INFO = encode_request(Op.INFO, b"", b"", b"probe")
PREFILL = encode_request(Op.PREFILL, b"3", b'{"prompt":"hi"}', b"trace-1", flags=0x80)


def test_whole_frames_in_order_with_their_parts():
    s = split_frames(INFO + PREFILL)
    assert s.tail == "clean" and s.rest == b""
    assert [f.raw for f in s.frames] == [INFO, PREFILL]
    info, prefill = s.frames
    assert (info.header.op, info.key, info.trace, info.payload) == (Op.INFO, b"", b"probe", b"")
    assert (prefill.header.op, prefill.header.flags) == (Op.PREFILL, 0x80)
    assert (prefill.key, prefill.trace, prefill.payload) == (b"3", b"trace-1", b'{"prompt":"hi"}')


def test_empty_input_is_clean_and_empty():
    s = split_frames(b"")
    assert (s.frames, s.rest, s.tail) == ([], b"", "clean")


def test_a_truncated_tail_is_partial():
    for cut in (1, REQUEST_HEADER_SIZE - 1, REQUEST_HEADER_SIZE, len(PREFILL) - 1):
        s = split_frames(INFO + PREFILL[:cut])
        assert [f.raw for f in s.frames] == [INFO] and s.rest == PREFILL[:cut] and s.tail == "partial", cut


def test_a_length_that_claims_more_than_was_sent_is_partial():
    lie = pack_request_header_unchecked(Op.CONFIGURE, 0, 1 << 40, 0) + b"{}"
    s = split_frames(lie)
    assert s.frames == [] and s.rest == lie and s.tail == "partial"


def test_bad_magic_is_garbage_and_nothing_after_it_is_cut():
    junk = b"GET / HTTP/1.1\r\n\r\n"
    s = split_frames(INFO + junk + INFO)
    assert [f.raw for f in s.frames] == [INFO] and s.rest == junk + INFO and s.tail == "garbage"


def test_too_few_bytes_to_tell_are_partial_even_without_magic():
    # Fewer than 16 bytes: a server waits for the rest of the header before it judges the magic.
    s = split_frames(INFO + b"GET")
    assert s.rest == b"GET" and s.tail == "partial"


@given(st.lists(st.tuples(st.sampled_from(list(Op)), st.binary(max_size=8), st.binary(max_size=40),
                          st.binary(max_size=8)), max_size=5), st.binary(max_size=40))
def test_frames_and_rest_put_back_together_are_the_input(reqs, tail):
    data = b"".join(encode_request(op, k, p, t) for op, k, p, t in reqs) + tail
    s = split_frames(data)
    assert b"".join(f.raw for f in s.frames) + s.rest == data
    assert len(s.frames) >= len(reqs)  # the tail may itself hold a request
    assert [f.raw for f in s.frames[:len(reqs)]] == [encode_request(*r) for r in reqs]
    assert (s.tail == "clean") == (s.rest == b"")
