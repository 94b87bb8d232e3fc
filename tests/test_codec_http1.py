"""codec/http1.py: HTTP/1.1 requests from bytes in any split, the head's limits, response bytes."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codec.http1 import (END, MAX_FIELD, MAX_HEAD, MAX_HEADERS, MAX_REQUESTS_PER_FEED, MAX_TARGET,
                         HttpProtocolError, RequestHead, RequestReader, chunk, response_head)

TWO = (b"POST /v1/completions?x=1&y=%20 HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello"
       b"GET /slots/%30/state/meta HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
       b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\n\r\n")


def events_of(pieces: list[bytes]) -> list:
    reader = RequestReader()
    out: list = []
    for p in pieces:
        out += reader.feed(p)
    return out


def summary(events: list) -> list:
    """Heads as (method, path, query), bodies joined per request, END kept."""
    out: list = []
    for ev in events:
        if isinstance(ev, RequestHead):
            out.append((ev.method, ev.path, ev.query_string, ev.content_length, ev.chunked, ev.keep_alive))
        elif ev is END:
            out.append("END")
        elif out and isinstance(out[-1], bytes):
            out[-1] += ev
        else:
            out.append(bytes(ev))
    return out


WHOLE = [("POST", "/v1/completions", "x=1&y=%20", 5, False, True), b"hello", "END",
         ("GET", "/slots/0/state/meta", "", None, True, True), b"abcde", "END"]


def test_two_pipelined_requests_with_both_framings():
    assert summary(events_of([TWO])) == WHOLE


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(TWO) - 1), max_size=12, unique=True))
def test_any_split_reads_the_same_requests(cuts):
    bounds = [0, *sorted(cuts), len(TWO)]
    assert summary(events_of([TWO[a:b] for a, b in zip(bounds, bounds[1:])])) == WHOLE


def test_headers_are_looked_up_in_any_case_and_repeats_join():
    (head, end) = events_of([b"GET / HTTP/1.1\r\nX-A: 1\r\nx-a: 2\r\nUser-Agent: u\r\n\r\n"])
    assert end is END and head.headers["X-A"] == "1, 2" and head.headers.get("user-agent") == "u"
    assert "USER-AGENT" in head.headers and head.headers.get("nope") is None


def test_http10_is_not_kept_alive_unless_asked():
    (a, _), (b, _) = (events_of([b"GET / HTTP/1.0\r\n\r\n"]),
                      events_of([b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"]))
    assert (a.keep_alive, b.keep_alive) == (False, True)
    (c, _) = events_of([b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n"])
    assert not c.keep_alive


def test_expect_continue_is_seen():
    (head,) = events_of([b"POST /x HTTP/1.1\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n"])
    assert head.expect_continue and head.has_body


@pytest.mark.parametrize("raw, status", [
    (b"HELLO\r\n\r\n", 400),
    (b"GET / HTTP/9.9\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400),  # smuggling
    (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nContent-Length: 1x\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"GET /" + b"a" * MAX_TARGET + b" HTTP/1.1\r\n\r\n", 414),
    (b"GET / HTTP/1.1\r\nX: " + b"v" * (MAX_FIELD + 1) + b"\r\n\r\n", 431),
    (b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEADERS + 1)) + b"\r\n", 431),
])
def test_what_is_refused_and_with_which_status(raw, status):
    with pytest.raises(HttpProtocolError) as ei:
        events_of([raw])
    assert ei.value.status == status


def test_a_head_that_never_ends_is_refused_once_it_passes_the_limit():
    """A header line that keeps growing, fed in small pieces: refused by size, not buffered."""
    reader = RequestReader()
    reader.feed(b"GET / HTTP/1.1\r\nX: ")
    with pytest.raises(HttpProtocolError) as ei:
        for _ in range(MAX_HEAD // 1000 + 2):
            reader.feed(b"v" * 1000)
    assert ei.value.status == 431


@pytest.mark.parametrize("start", [b"0\r\nX-Trailer: ", b"5;ext="], ids=["trailer", "chunk-extension"])
def test_a_trailer_or_chunk_size_line_that_never_ends_is_refused_once_it_passes_the_limit(start):
    """llhttp keeps a trailer line whole until it ends: a client could grow it without bound."""
    reader = RequestReader()
    reader.feed(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n" + start)
    with pytest.raises(HttpProtocolError) as ei:
        for _ in range(MAX_HEAD // 1000 + 2):
            reader.feed(b"v" * 1000)
    assert ei.value.status == 431


def test_chunks_split_anywhere_with_trailers_are_read():
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (b"a" * 5000, b"b" * 70000, b"c"))
    raw = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\nX-T: 1\r\n\r\n"
    for step in (1, 7, 4096, 65536):
        got = summary(events_of([raw[i:i + step] for i in range(0, len(raw), step)]))
        assert got[1:] == [b"a" * 5000 + b"b" * 70000 + b"c", "END"], step


def test_a_flood_of_pipelined_requests_in_one_read_is_refused_before_its_requests_are_made():
    one = b"GET /health HTTP/1.1\r\n\r\n"
    assert len(events_of([one * MAX_REQUESTS_PER_FEED])) == 2 * MAX_REQUESTS_PER_FEED  # a head and END each
    with pytest.raises(HttpProtocolError) as ei:
        events_of([one * 10_000])
    assert ei.value.status == 429
    reader = RequestReader()  # the same requests over several reads are read
    assert sum(len(reader.feed(one * MAX_REQUESTS_PER_FEED)) for _ in range(3)) == 6 * MAX_REQUESTS_PER_FEED


def test_an_upgrade_is_read_as_the_last_request():
    reader = RequestReader()
    (head, end) = reader.feed(b"GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\nGET / HTTP/1.1\r\n")
    assert head.upgrade and not head.keep_alive and end is END and reader.upgraded
    assert reader.feed(b"\r\n") == []


def test_response_head_and_chunks():
    assert response_head(404, [("Content-Length", "2")]) == b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n"
    assert chunk(b"x" * 26) == b"1a\r\n" + b"x" * 26 + b"\r\n"
    with pytest.raises(ValueError):
        response_head(200, [("X-Echo", "a\r\nSet-Cookie: b")])


def _feed_all(pieces: list[bytes]) -> None:
    reader = RequestReader()
    try:
        for p in pieces:
            for ev in reader.feed(p):
                assert isinstance(ev, (RequestHead, bytes)) or ev is END
    except HttpProtocolError as e:
        assert e.status in (400, 414, 429, 431)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.lists(st.integers(min_value=1, max_value=599), max_size=6, unique=True))
def test_any_bytes_are_read_or_refused_with_a_status(data, cuts):
    bounds = [0, *sorted(c for c in cuts if c < len(data)), len(data)]
    _feed_all([data[a:b] for a, b in zip(bounds, bounds[1:])])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(min_value=0, max_value=len(TWO) - 1), st.integers(0, 255)), max_size=4))
def test_mutated_requests_are_read_or_refused_with_a_status(flips):
    data = bytearray(TWO)
    for at, value in flips:
        data[at] = value
    _feed_all([bytes(data)])
